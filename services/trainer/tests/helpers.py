"""Test helpers: random datums and adapters, and an independent plain-torch LoRA reference.

The reference runs the Hugging Face model one datum at a time (no packing, no megatron) with a
hand-written LoRA on HF's separate projections: every projection has its own ``A`` and ``B``
(Tinker's LoRA shape), each its own parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from services.trainer import attention
from services.trainer.engine import DatumInput, LoraConfig, TrainerEngine
from services.trainer.lora import lora_scaling
from services.trainer.peft_export import export_peft
from services.trainer.slot_state import SlotState
from tests.numerics import U32, ChainShape, gamma, logit_magnitude, logprob_magnitude

VOCAB = 2048


def record_causal_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on each call of ``attention._causal_sdpa`` (one document's dense causal attention)
    appends its ``cudnn`` flag to the returned list, then runs as before."""
    calls: list[bool] = []
    causal = attention._causal_sdpa

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cudnn: bool) -> torch.Tensor:
        calls.append(cudnn)
        return causal(q, k, v, scale, cudnn=cudnn)

    monkeypatch.setattr(attention, "_causal_sdpa", recorded)
    return calls


def random_tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    seq = rng.integers(0, VOCAB, n + 1)
    return seq[:-1].astype(np.int64), seq[1:].astype(np.int64)


def ce_datum(rng: np.random.Generator, slot: int, n: int) -> DatumInput:
    tokens, targets = random_tokens(rng, n)
    weights = rng.normal(size=n).astype(np.float32)  # arbitrary signs
    return DatumInput(slot, tokens, {"target_tokens": targets, "weights": weights})


def randomize_slot(
    engine: TrainerEngine, slot: int, config: LoraConfig, seed: int, std: float = 0.05
) -> SlotState:
    """Initialise ``slot`` with ``config`` and random non-zero A and B (so every grad is non-zero)."""
    engine.init_slot(slot, config)
    state = engine.get_slot_state(slot)
    gen = torch.Generator().manual_seed(seed)
    adapter = {name: torch.randn(t.shape, generator=gen) * std for name, t in state.adapter.items()}
    new = SlotState(config, 0, adapter)
    engine.set_slot_state(slot, new, with_optimizer=False)
    return new


def to_hf_layout(
    tensors: dict[str, torch.Tensor], config: LoraConfig, engine: TrainerEngine
) -> dict[str, torch.Tensor]:
    """Full-layout adapter tensors (or grads) renamed and split to PEFT keys."""
    return export_peft(SlotState(config, 0, tensors), engine.shape, "")[0]


class _RefLoRALinear(nn.Module):
    """``base(x) + s * B(A x)``; records the magnitudes of the terms of ``dL/dA`` and ``dL/dB``
    (for ``tests.numerics``) when the backward pass runs through it."""

    def __init__(
        self, base: nn.Linear, a: nn.Parameter, b: nn.Parameter, scaling: float, magnitudes: _Magnitudes
    ) -> None:
        super().__init__()
        self.base, self.a, self.b, self.scaling, self.magnitudes = base, a, b, scaling, magnitudes
        self.logit_mag: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ax = x @ self.a.t()  # [.., r]
        out = self.base(x) + self.scaling * (ax @ self.b.t())  # [.., out]
        # |terms| of every output: |x||W| + s (|x||A|)|B|
        self.logit_mag = logit_magnitude(x, self.base.weight) + self.scaling * logit_magnitude(
            logit_magnitude(x, self.a), self.b
        )
        if out.requires_grad:
            xa, axa = x.detach().abs().double().flatten(0, -2), ax.detach().abs().double().flatten(0, -2)

            def record(dy: torch.Tensor) -> None:
                dya = dy.detach().abs().double().flatten(0, -2)  # [T, out]
                s = self.scaling
                self.magnitudes.add(self.b, s * dya.t() @ axa)  # dL/dB = s dy^T (A x)
                self.magnitudes.add(self.a, s * (dya @ self.b.detach().abs().double()).t() @ xa)  # s (B^T dy) x^T

            out.register_hook(record)
        return out


class _Magnitudes:
    """Sum over every token and datum of |terms| of each parameter's gradient, keyed by parameter."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}

    def add(self, param: nn.Parameter, terms: torch.Tensor) -> None:
        key = id(param)
        self.sums[key] = self.sums[key] + terms if key in self.sums else terms


class ReferenceLoRAModel:
    """HF model + plain-torch LoRA built from PEFT-keyed tensors, in float64 by default (a
    reference whose own rounding is negligible next to the fp32 engine's)."""

    def __init__(
        self,
        model_dir: Path,
        peft: dict[str, torch.Tensor] | None = None,
        config: LoraConfig | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.model.to(dtype)
        self.dtype = dtype
        self.chain = ChainShape.of_hf_config(self.model.config)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.params: dict[str, nn.Parameter] = {}
        self.magnitudes = _Magnitudes()
        modules = dict(self.model.named_modules())
        prefix = "base_model.model."
        peft = peft or {}  # no adapter: the base model
        names = sorted({k[len(prefix) : -len(".lora_A.weight")] for k in peft if k.endswith("lora_A.weight")})
        for name in names:
            a_key = f"{prefix}{name}.lora_A.weight"
            self.params[a_key] = nn.Parameter(peft[a_key].clone().to(dtype))
            b_key = f"{prefix}{name}.lora_B.weight"
            self.params[b_key] = nn.Parameter(peft[b_key].clone().to(dtype))
            parent_name, _, attr = name.rpartition(".")
            base = modules[name]
            assert isinstance(base, nn.Linear)
            assert config is not None
            wrapped = _RefLoRALinear(base, self.params[a_key], self.params[b_key], lora_scaling(config.rank), self.magnitudes)
            setattr(modules[parent_name], attr, wrapped)
        self._lm_head_in: torch.Tensor | None = None
        self._logit_mag = torch.zeros(0)
        self._logit_mag_max = 0.0
        self.model.lm_head.register_forward_hook(lambda _m, args, _out: setattr(self, "_lm_head_in", args[0]))

    def logits(self, tokens: np.ndarray) -> torch.Tensor:
        """[N, V] logits of one document; records the magnitudes their bounds need."""
        logits = self.model(torch.from_numpy(tokens)[None]).logits[0].to(self.dtype)  # [N, V]
        head = self.model.lm_head
        if isinstance(head, _RefLoRALinear):
            assert head.logit_mag is not None
            self._logit_mag = head.logit_mag[0]
        else:
            assert self._lm_head_in is not None
            self._logit_mag = logit_magnitude(self._lm_head_in[0], head.weight)
        self._logit_mag_max = max(self._logit_mag_max, float(self._logit_mag.max()))
        return logits

    def logit_bound(self, tokens: int) -> torch.Tensor:
        """fp32 error bound of each logit of the last ``logits`` call (``tests.numerics``)."""
        return gamma(self.chain.forward_depth(tokens)) * self._logit_mag

    def logprobs(self, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        logp = torch.log_softmax(self.logits(tokens), dim=-1)  # [N, V]
        return logp.gather(-1, torch.from_numpy(targets)[:, None])[:, 0]  # [N]

    def logprob_bound(self, targets: np.ndarray, u: float = U32) -> torch.Tensor:
        """Error bound (unit roundoff ``u``: fp32 by default) of each logprob of the last
        ``logprobs`` call (``tests.numerics``)."""
        depth = self.chain.forward_depth(len(targets))
        return gamma(depth, u) * logprob_magnitude(self._logit_mag, torch.from_numpy(targets))

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in self.params.items()
        }

    def grad_bounds(self, longest_datum: int, total_tokens: int, u: float = U32) -> dict[str, torch.Tensor]:
        """Error bound (unit roundoff ``u``) of every gradient entry accumulated since the last
        ``zero_grad``.

        Two sources: the rounding of the backward chain (the magnitude of the entry's terms times
        gamma of the longest datum's forward-and-back chain plus the sum over every token), and the
        backward's seeds, ``softmax(z) - onehot``: an absolute error ``dz`` in the logits moves the
        softmax by up to ``2 |dz|`` relative, and ``|dz| <= gamma(forward) * max logit magnitude``.
        """
        chain = gamma(self.chain.backward_depth(longest_datum) + total_tokens, u)
        seeds = 2 * gamma(self.chain.forward_depth(longest_datum), u) * self._logit_mag_max
        return {k: (chain + seeds) * self.magnitudes.sums[id(p)] for k, p in self.params.items()}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        self.magnitudes.sums.clear()
        self._logit_mag_max = 0.0


@dataclass(frozen=True)
class Bounds:
    """Error bounds of one slot's outputs (``tests.numerics``), from the float64 reference."""

    logprobs: list[torch.Tensor]  # per datum, [N]
    grads: dict[str, torch.Tensor]  # PEFT keys
    grad_magnitudes: dict[str, torch.Tensor]  # sum of |terms| of every gradient entry


def ce_bounds(
    model_dir: Path, engine: TrainerEngine, state: SlotState, datums: list[DatumInput], u: float = U32
) -> Bounds:
    """Error bounds (unit roundoff ``u``) of the logprobs and the PEFT-keyed gradients of one slot's
    cross-entropy datums."""
    ref = ReferenceLoRAModel(model_dir, to_hf_layout(state.adapter, state.config, engine), state.config)
    lp_bounds = []
    for d in datums:
        targets = np.asarray(d.loss_inputs["target_tokens"])
        lp = ref.logprobs(d.tokens, targets)
        lp_bounds.append(ref.logprob_bound(targets, u))
        (-(torch.from_numpy(np.asarray(d.loss_inputs["weights"])).double() * lp).sum()).backward()
    lengths = [d.num_tokens for d in datums]
    magnitudes = {k: ref.magnitudes.sums[id(p)] for k, p in ref.params.items()}
    return Bounds(lp_bounds, ref.grad_bounds(max(lengths), sum(lengths), u), magnitudes)


def output_and_input_grad(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` and the gradient of ``x`` for the output gradient ``grad`` (``x`` copied as a leaf)."""
    leaf = x.detach().clone().requires_grad_()
    y = fn(leaf)
    y.backward(grad)
    assert leaf.grad is not None
    return y.detach(), leaf.grad


def steps_apart(got: torch.Tensor, ref: torch.Tensor, absolute: float) -> torch.Tensor:
    """Per value: whether ``got`` is more than one rounding step of ``ref``'s dtype plus
    ``absolute`` from ``ref``, or non-finite where ``ref`` is not (or a different non-finite
    value)."""
    g, r = got.double(), ref.double()
    same = (g.isnan() & r.isnan()) | (g.isinf() & (g == r))
    close = g.isfinite() & r.isfinite() & ((g - r).abs() <= torch.finfo(ref.dtype).eps * r.abs() + absolute)
    return ~(same | close)
