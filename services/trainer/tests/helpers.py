"""Test helpers: random datums and adapters, and an independent plain-torch LoRA reference.

The reference runs the Hugging Face model one datum at a time (no packing, no megatron) with a
hand-written LoRA on HF's separate projections; q/k/v share one ``A`` and gate/up share one
``A`` (the fused adapters' math), every other tensor is its own parameter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from services.trainer.engine import DatumInput, TrainerEngine
from services.trainer.lora import SlotConfig
from services.trainer.peft_export import export_peft
from services.trainer.slot_state import SlotState

VOCAB = 2048


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5, what: str = ""
) -> None:
    """``max|actual - expected| <= tol * max(1, max|expected|)`` (fp32 noise grows with scale)."""
    scale = max(1.0, float(expected.abs().max()))
    diff = float((actual.double() - expected.double()).abs().max())
    assert diff <= tol * scale, f"{what}: max diff {diff:.3g} > {tol:g} * {scale:.3g}"


def random_tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    seq = rng.integers(0, VOCAB, n + 1)
    return seq[:-1].astype(np.int64), seq[1:].astype(np.int64)


def ce_datum(rng: np.random.Generator, slot: int, n: int) -> DatumInput:
    tokens, targets = random_tokens(rng, n)
    weights = rng.normal(size=n).astype(np.float32)  # arbitrary signs
    return DatumInput(slot, tokens, {"target_tokens": targets, "weights": weights})


def randomize_slot(
    engine: TrainerEngine, slot: int, config: SlotConfig, seed: int, std: float = 0.05
) -> SlotState:
    """Initialise ``slot`` with ``config`` and random non-zero A and B (so every grad is non-zero)."""
    engine.init_slot(
        slot, config.rank, config.seed, config.train_attn, config.train_mlp, config.train_unembed
    )
    state = engine.get_slot_state(slot)
    gen = torch.Generator().manual_seed(seed)
    adapter = {name: torch.randn(t.shape, generator=gen) * std for name, t in state.adapter.items()}
    new = SlotState(config, 0, adapter)
    engine.set_slot_state(slot, new, with_optimizer=False)
    return new


def to_hf_layout(
    tensors: dict[str, torch.Tensor], config: SlotConfig, engine: TrainerEngine
) -> dict[str, torch.Tensor]:
    """Full-layout adapter tensors (or grads) renamed and split to PEFT keys."""
    return export_peft(SlotState(config, 0, tensors), engine.shape, "")[0]


class _RefLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, a: nn.Parameter, b: nn.Parameter, scaling: float) -> None:
        super().__init__()
        self.base, self.a, self.b, self.scaling = base, a, b, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * ((x @ self.a.t()) @ self.b.t())  # [.., out]


class ReferenceLoRAModel:
    """HF model + plain-torch LoRA built from PEFT-keyed tensors."""

    def __init__(self, model_dir: Path, peft: dict[str, torch.Tensor], config: SlotConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.params: dict[str, nn.Parameter] = {}
        shared_a = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
        modules = dict(self.model.named_modules())
        prefix = "base_model.model."
        names = sorted({k[len(prefix) : -len(".lora_A.weight")] for k in peft if k.endswith("lora_A.weight")})
        # Create owners of shared A first (q before k/v, gate before up).
        for name in sorted(names, key=lambda n: n.split(".")[-1] in shared_a):
            leaf = name.split(".")[-1]
            a_key = f"{prefix}{name}.lora_A.weight"
            if leaf in shared_a:
                owner = f"{prefix}{name.rsplit('.', 1)[0]}.{shared_a[leaf]}.lora_A.weight"
                self.params[a_key] = self.params[owner]
            else:
                self.params[a_key] = nn.Parameter(peft[a_key].clone())
            b_key = f"{prefix}{name}.lora_B.weight"
            self.params[b_key] = nn.Parameter(peft[b_key].clone())
            parent_name, _, attr = name.rpartition(".")
            base = modules[name]
            assert isinstance(base, nn.Linear)
            wrapped = _RefLoRALinear(base, self.params[a_key], self.params[b_key], config.scaling)
            setattr(modules[parent_name], attr, wrapped)

    def logprobs(self, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        logits = self.model(torch.from_numpy(tokens)[None]).logits[0]  # [N, V]
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        return logp.gather(-1, torch.from_numpy(targets)[:, None])[:, 0]  # [N]

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in self.params.items()
        }

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
