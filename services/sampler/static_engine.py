"""The static-cache sampling engine: the CUDA path of the sampler (bf16), also runnable on CPU.

``StaticCacheEngine`` keeps ``HFEngine``'s public API, validation, scheduling loop and adapter
registry, and replaces its forward passes:

* **KV cache.**  One preallocated tensor per K and V, ``(layers, max_batch, kv_heads,
  context_length, head_dim)``.  Running row ``i`` owns cache row ``i`` (rows stay compact: when
  rows finish, later rows move down into the holes, copying only their filled columns).  The
  padding rows of a bucketed step use free rows.  Without a configured ``context_length``
  the cache has ``DEFAULT_CONTEXT`` columns per row.
* **Forward.**  Written here over the Hugging Face modules' own weights, with q/k/v and gate/up
  each concatenated into one weight at load (the modules' weights become views of it): per
  layer RMSNorm, the fused projections, Qwen3's q/k norms when present, RoPE, attention against
  the static cache, SiLU-gated MLP.  Prefill writes a row's prompt keys/values at columns
  ``[0, n)`` and runs causal SDPA; a decode step (``decode_ops``: Triton kernels on CUDA, their
  torch twins on the CPU) writes each row's pending token at its own position and attends over
  columns ``[0, position]`` of its own row only.
* **LoRA.**  Adapters are copied into the slots of a ``LoRAPool`` (per fused projection one
  ``A``/``B`` pair for all slots).  Every slot's ``A`` is kept as extra rows of its projection's
  weight (``[W; A]``), so the one GEMM of a projection gives the base output and every slot's
  ``x A^T`` at once; every row carries its slot, and a row's LoRA term is its own slot's columns
  of that output times its slot's ``B`` (``decode_ops.add_lora``; prefill the same in torch), so
  a step over any mix of adapters has fixed shapes and no row sees another slot.  A row waits
  for admission while every slot is held by other running adapters.
* **CUDA graphs.**  On CUDA each decode step replays a graph captured for its (batch bucket,
  cache-length bucket, slot span): batch padded to a power of two up to ``max_batch_size``,
  attention window to a power of two from 256 up to ``context_length``, and the slots whose
  ``A`` rows the GEMMs read: none for a step without adapters (the base rows alone, no LoRA
  kernels), else the first 1, 2, 4, ... slots up to the highest slot in use (the pool hands out
  low slots first).  The host uploads three small
  vectors (tokens, positions, slots), replays, and reads back one (2, B) tensor of greedy tokens
  and their logprobs, computed inside the graph: one host sync per step.  Greedy rows are decided inside the graph; rows that sample
  use their own seeded ``torch.Generator`` on the device (``sampling.choose_token_tensor``).
* **Look-ahead.**  While the host reads a step's tokens and checks its rows' stop conditions,
  the device already runs the next step (``SamplerConfig.decode_lookahead``): its inputs are the
  chosen tokens, still on the device, and every position plus one, so the GPU does not idle
  for the host's part of a step.  A step is launched ahead only for the same rows (none finished
  or joined since the one it follows), while no request waits that the batch could admit, and
  while some row can still outlive its ``max_new_tokens``; a row that stops on a stop token meanwhile has
  one step computed for nothing, whose results are dropped (its cache row is freed as usual).
  Tokens are chosen by the same code from the same generator draws as step by step; a step that
  still carries a finished row can run in a larger batch bucket than step by step would (other
  GEMM shapes, so logprobs may differ in their last bits, as when a row joins a batch).

Numerics: the same function as ``HFEngine`` (temperature-1 ``log_softmax`` of fp32 logits);
on CUDA the model runs in bf16 (logits cast to fp32 before the softmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.sampler import decode_ops as ops
from services.sampler.engine import HFEngine, _Row
from services.sampler.interface import TopK
from services.sampler.lora import LoadedAdapter, LoRAPool, PoolGroup
from services.sampler.sampling import Finish, choose_token_tensor, is_greedy

DEFAULT_CONTEXT = 4096
"""Cache columns per row when ``context_length`` is not configured (the model may allow far more)."""
MIN_WINDOW = 256
"""Smallest attention window (cache columns) a decode graph is captured for."""


def _buckets(limit: int, first: int) -> list[int]:
    out, size = [], first
    while size < limit:
        out.append(size)
        size *= 2
    return [*out, limit]


def _bucket(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)


@dataclass(frozen=True, slots=True)
class _Projection:
    """One fused projection: weight ``[W; A]`` (out + slots * R, in) with every LoRA slot's ``A``
    below the base rows, its bias (zeros under ``A``), ``out`` base output columns, and its LoRA
    pool group (whose ``a`` is the weight's rows under ``out``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    out: int
    lora: PoolGroup


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv: _Projection
    o: _Projection
    gate_up: _Projection
    down: _Projection
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _fuse(linears: list[nn.Linear], extra_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` that read the same input, with ``extra_rows`` zero
    rows below theirs (bias zero there); each module's own weight becomes a view of its rows, so
    the fused copy costs no memory beyond the extra rows."""
    first = linears[0].weight
    out = sum(m.out_features for m in linears)
    weight = torch.zeros(out + extra_rows, first.shape[1], device=first.device, dtype=first.dtype)
    bias = None
    if any(m.bias is not None for m in linears):
        bias = weight.new_zeros(out + extra_rows)
    lo = 0
    for m in linears:
        hi = lo + m.out_features
        weight[lo:hi] = m.weight
        m.weight = nn.Parameter(weight[lo:hi], requires_grad=False)
        if m.bias is not None and bias is not None:
            bias[lo:hi] = m.bias
            m.bias = nn.Parameter(bias[lo:hi], requires_grad=False)
        lo = hi
    return weight, bias


class _Graph:
    """One captured decode step and its output tensors (valid until the next replay)."""

    def __init__(self, graph: Any, outputs: tuple[torch.Tensor, ...]) -> None:
        self.graph = graph
        self.outputs = outputs


@dataclass(slots=True)
class _Step:
    """A decode step launched on the device whose results the host has not read yet.

    ``index[j]`` is the column of running row ``j``'s result (rows that finished since the
    launch are left out); ``chosen`` holds the tokens chosen, on the device (a step launched
    ahead reads them as its inputs); ``host`` receives (token, logprob) rows by a copy that
    ``ready`` marks done (None: already done, on the CPU)."""

    index: list[int]
    chosen: torch.Tensor
    host: torch.Tensor
    ready: Any
    tops: list[list[TopK]]


class StaticCacheEngine(HFEngine):
    """``HFEngine`` with a static KV cache, pooled LoRA slots and CUDA-graph decode steps."""

    def _load_model(self, model_dir: Path) -> PreTrainedModel:
        self.device = torch.device(self.config.torch_device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        kwargs: dict[str, Any] = {"device_map": str(self.device)} if self.device.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, attn_implementation="sdpa", local_files_only=True, **kwargs
        )
        return cast(PreTrainedModel, cast(Any, model).to(self.device))

    def _prepare(self) -> None:
        cfg = self.model.config
        decoder = self._decoder
        self._layers = list(cast(Any, decoder).layers)
        self._embed = cast(nn.Module, cast(Any, decoder).embed_tokens)
        self._norm = cast(nn.Module, cast(Any, decoder).norm)
        self._rotary = cast(nn.Module, cast(Any, decoder).rotary_emb)
        attn = self._layers[0].self_attn
        self._heads = int(cfg.num_attention_heads)
        self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self._heads)
        self._head_dim = int(getattr(attn, "head_dim", cfg.hidden_size // self._heads))
        self._scale = float(getattr(attn, "scaling", self._head_dim**-0.5))
        self._qk_norm = hasattr(attn, "q_norm")
        self._eps = float(getattr(self._layers[0].input_layernorm, "variance_epsilon", 1e-6))
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"the static engine supports SiLU-gated MLPs, not {cfg.hidden_act!r}")
        names = {id(m): n for n, m in self.model.named_modules()}
        self._layer_names = [names[id(layer)] for layer in self._layers]
        self._head_name = str(getattr(self._lm_head, "name", ""))
        self._max_batch = self.config.max_batch_size
        if self.config.context_length is None and self.info.context_length > DEFAULT_CONTEXT:
            self.info = msgspec.structs.replace(self.info, context_length=DEFAULT_CONTEXT)
        self.info = msgspec.structs.replace(
            self.info, dtype=str(self.dtype).removeprefix("torch."), device=self.device.type
        )
        self._context = self.info.context_length
        shape = (len(self._layers), self._max_batch, self._kv_heads, self._context, self._head_dim)
        with torch.inference_mode():
            self._k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self._v = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self._pool = LoRAPool(
                self._lora_groups(),
                self._bases,
                self.config.max_loaded_loras,
                self.config.max_lora_rank,
                self.device,
                self.dtype,
            )
            self._fused = [self._fuse_layer(i) for i in range(len(self._layers))]
            head = self._bases.get(self._head_name)
            if head is None:
                raise ValueError("the static engine needs an nn.Linear lm_head")
            tied = head.weight is cast(Any, self._embed).weight
            self._head = self._folded("lm_head", [head])
            if tied:  # the embedding keeps sharing the lm_head's (now folded) rows
                cast(Any, self._embed).weight = head.weight
            # Static inputs of a decode step (graph-captured): tokens, positions, LoRA slots.
            self._inputs = torch.zeros(3, self._max_batch, dtype=torch.long, device=self.device)
            self._host_inputs = torch.zeros(
                3, self._max_batch, dtype=torch.long, pin_memory=self.device.type == "cuda"
            )
            self._arange = torch.arange(self._max_batch, device=self.device)
            # (token, logprob) rows of a step read back, flat so that a step's [2, n] is contiguous
            # (a device-to-host copy into a strided or pageable buffer waits for the stream); two:
            # a step launched ahead of an unread one
            self._host_outputs = [
                torch.zeros(2 * self._max_batch, dtype=torch.float64, pin_memory=self.device.type == "cuda")
                for _ in range(2)
            ]
            self._copied = [torch.cuda.Event() for _ in range(2)] if self.device.type == "cuda" else None
        self._next_output = 0
        self._ahead: _Step | None = None  # launched ahead of the running rows' last read
        self._batch_buckets = _buckets(self._max_batch, 1)
        self._window_buckets = _buckets(self._context, min(MIN_WINDOW, self._context))
        self._span_buckets = _buckets(self._pool.slots, 1)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._graph_pool: Any = None
        self.graphs_captured = 0
        self._use_graphs = self.device.type == "cuda" and self.config.cuda_graphs
        self._pos: list[int] = []  # per running row: position of its pending token
        self._slot: list[int] = []  # per running row: LoRA pool slot (-1: base model)
        self._pending: list[int] = []  # per running row: last sampled token, not yet in the cache

    # ----------------------------------------------------------------- scheduling

    def _take_admissions(self) -> list[_Row]:
        """Up to ``max_batch_size`` rows within ``prefill_tokens``, whose adapters fit the pool."""
        admitted: list[_Row] = []
        adapters = {id(r.adapter) for r in self._rows if r.adapter is not None}
        width = 0
        while self._waiting and len(self._rows) + len(admitted) < self.config.max_batch_size:
            row = self._waiting[0]
            if row.future.done():
                self._waiting.popleft()
                continue
            need = adapters | ({id(row.adapter)} if row.adapter is not None else set())
            longest = max(width, len(row.req.input_ids))
            if len(need) > self._pool.slots:
                break  # its adapter needs a slot that running rows hold: wait for them
            if admitted and longest * (len(admitted) + 1) > self.config.prefill_tokens:
                break
            self._waiting.popleft()
            admitted.append(row)
            adapters, width = need, longest
        return admitted

    def _reset_batch(self) -> None:
        super()._reset_batch()
        self._pos, self._slot, self._pending = [], [], []
        self._ahead = None

    def _retain(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (increasing): each moves down to cache row ``j``."""
        # columns [0, pos) hold a row's keys and values, and column pos too while a step launched
        # ahead writes it (the copies run after that step: one stream)
        extra = 0 if self._ahead is None else 1
        for j, src in enumerate(keep):
            if src != j:
                used = self._pos[src] + extra
                self._k[:, j, :, :used].copy_(self._k[:, src, :, :used])
                self._v[:, j, :, :used].copy_(self._v[:, src, :, :used])
        self._rows = [self._rows[i] for i in keep]
        self._pos = [self._pos[i] for i in keep]
        self._slot = [self._slot[i] for i in keep]
        self._pending = [self._pending[i] for i in keep]
        if self._ahead is not None:
            self._ahead.index = [self._ahead.index[i] for i in keep]
            if not keep:
                self._ahead = None

    def _drop_abandoned(self) -> None:
        if self._ahead is not None and any(row.future.done() for row in self._rows):
            self._settle()
        keep = [i for i, row in enumerate(self._rows) if not row.future.done()]
        if len(keep) < len(self._rows):
            self._retain(keep)

    def _settle(self) -> None:
        """Read the step launched ahead, if any: the running rows are then as the host knows them."""
        step, self._ahead = self._ahead, None
        if step is not None:
            self._process(step)

    # ----------------------------------------------------------------- model pieces

    def _lora_groups(self) -> dict[str, tuple[str, ...]]:
        """Pool groups: per layer q/k/v, o, gate/up, down (each a fused projection), lm_head."""
        groups: dict[str, tuple[str, ...]] = {}
        for prefix in self._layer_names:
            attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
            groups[f"{prefix}.qkv"] = (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj")
            groups[f"{prefix}.o"] = (f"{attn}.o_proj",)
            groups[f"{prefix}.gate_up"] = (f"{mlp}.gate_proj", f"{mlp}.up_proj")
            groups[f"{prefix}.down"] = (f"{mlp}.down_proj",)
        missing = [m for members in groups.values() for m in members if m not in self._bases]
        if missing:
            raise ValueError(f"the static engine needs nn.Linear projections; missing {missing[:3]}")
        groups["lm_head"] = (self._head_name,)
        return groups

    def _folded(self, group: str, linears: list[nn.Linear]) -> _Projection:
        """The fused weight of ``linears`` with every slot's ``A`` of pool group ``group`` folded
        in below it (the pool keeps its ``A`` there from now on)."""
        slots, rows, _ = self._pool.groups[group].a.shape
        weight, bias = _fuse(linears, slots * rows)
        out = sum(m.out_features for m in linears)
        self._pool.place_a(group, weight[out:])
        return _Projection(weight, bias, out, self._pool.groups[group])

    def _fuse_layer(self, i: int) -> _Layer:
        prefix, layer = self._layer_names[i], self._layers[i]
        groups = self._pool.groups

        def projection(group: str) -> _Projection:
            name = f"{prefix}.{group}"
            return self._folded(name, [self._bases[m] for m in groups[name].members])

        attn = layer.self_attn
        return _Layer(
            qkv=projection("qkv"),
            o=projection("o"),
            gate_up=projection("gate_up"),
            down=projection("down"),
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            q_norm=attn.q_norm.weight if self._qk_norm else None,
            k_norm=attn.k_norm.weight if self._qk_norm else None,
        )

    @staticmethod
    def _project(
        p: _Projection,
        x: torch.Tensor,
        slots: torch.Tensor,
        groups: tuple[torch.Tensor, torch.Tensor] | None = None,
        span: int | None = None,
    ) -> torch.Tensor:
        """Rows ``x`` (B, in) through ``p``, each row with its own LoRA slot (``groups``: the
        rows grouped by slot, ``ops.group_rows``, shared by a step's projections). ``span``:
        every row's slot is below it, so the GEMM reads the ``A`` rows of the first ``span``
        slots only (None: all; 0: the base rows alone, and no LoRA term). On CUDA the result is
        a view of the folded GEMM's output (rows strided)."""
        y = StaticCacheEngine._gemm(p, x, span)
        if span == 0:
            return y
        return ops.add_lora(y, p.out, p.lora.b, slots, p.lora.bounds, groups, p.lora.a.shape[1])

    @staticmethod
    def _gemm(p: _Projection, x: torch.Tensor, span: int | None) -> torch.Tensor:
        """The folded GEMM: ``x`` through the base rows and the ``A`` rows of the first ``span``
        slots (None: all)."""
        rows = p.weight.shape[0] if span is None else p.out + span * p.lora.a.shape[1]
        return F.linear(x, p.weight[:rows], None if p.bias is None else p.bias[:rows])

    @classmethod
    def _project_deferred(
        cls,
        p: _Projection,
        x: torch.Tensor,
        slots: torch.Tensor,
        groups: tuple[torch.Tensor, torch.Tensor] | None,
        span: int | None,
        defer: bool,
    ) -> tuple[torch.Tensor, ops.RowLora | None]:
        """``_project``, or with ``defer`` the folded GEMM's whole output and the LoRA term for the
        kernel that reads it next to add (``ops.RowLora``)."""
        if not defer:
            return cls._project(p, x, slots, groups, span), None
        return cls._gemm(p, x, span), ops.RowLora(p.lora.b, slots, p.out, p.lora.bounds, p.lora.a.shape[1])

    @staticmethod
    def _project_seq(p: _Projection, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Prompts ``x`` (k, T, in) through ``p``, row ``j``'s tokens with slot ``slots[j]``."""
        return ops.lora_expand_torch(F.linear(x, p.weight, p.bias), p.out, p.lora.b, slots, p.lora.bounds)

    def _unembed(
        self,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        residual: torch.Tensor | None = None,
        groups: tuple[torch.Tensor, torch.Tensor] | None = None,
        span: int | None = None,
    ) -> torch.Tensor:
        """fp32 logits (N, V) of final hidden states ``hidden + residual`` (N, H), before the norm."""
        h, _ = ops.rms_norm(hidden, cast(torch.Tensor, self._norm.weight), self._eps, residual)
        return self._project(self._head, h, slots, groups, span).float()

    def slot_span(self, slots: list[int]) -> int:
        """The span bucket of a step whose rows use ``slots`` (-1: none): 0 without adapters,
        else the highest slot plus one, rounded up to a power of two (at most the pool's)."""
        top = max(slots, default=-1) + 1
        return 0 if top == 0 else _bucket(top, self._span_buckets)

    def _decode_forward(self, b: int, window: int, span: int | None = None) -> tuple[torch.Tensor, ...]:
        """One decode step of rows ``[0, b)`` over cache columns ``[0, window)`` (static shapes),
        every row's slot below ``span`` (``_project``; None: any slot).

        Returns fp32 logits (b, V), the greedy token of each row, and (2, b) float64: the
        greedy tokens and their logprobs (temperature 1), the one tensor a greedy step reads."""
        tokens, positions, slots = self._inputs[0, :b], self._inputs[1, :b], self._inputs[2, :b]
        x = self._embed(tokens)  # (b, H)
        cos, sin = self._rotary(x[:, None], positions[:, None])
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()  # (b, D)
        lengths = positions + 1
        groups = ops.group_rows(slots, self._pool.slots) if ops.use_triton(x) and span != 0 else None
        fuse = span != 0 and ops.fuses_expand(x)  # q/k/v and gate/up terms added by the next kernels
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self._fused):
            h, x = ops.rms_norm(x, layer.input_norm, self._eps, residual)
            qkv, lora = self._project_deferred(layer.qkv, h, slots, groups, span, fuse)
            q = ops.qk_rope_cache(
                qkv, layer.q_norm, layer.k_norm, self._eps, cos, sin, self._k[i], self._v[i],
                positions, self._heads, self._kv_heads, lora,
            )  # fmt: skip
            o = ops.decode_attention(q, self._k[i], self._v[i], lengths, self._scale, window)
            o = self._project(layer.o, o.reshape(b, -1), slots, groups, span)
            h, x = ops.rms_norm(x, layer.post_norm, self._eps, o)
            act = ops.silu_mul(*self._project_deferred(layer.gate_up, h, slots, groups, span, fuse))
            residual = self._project(layer.down, act, slots, groups, span)
        return self._greedy_outputs(self._unembed(x, slots, residual, groups, span))

    @staticmethod
    def _greedy_outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        greedy = torch.argmax(logits, dim=-1)
        picked = logits.gather(1, greedy[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return logits, greedy, torch.stack([greedy.double(), picked.double()])

    def _step_outputs(self, b: int, window: int, span: int | None = None) -> tuple[torch.Tensor, ...]:
        span = self._pool.slots if span is None else span
        if not self._use_graphs:
            return self._decode_forward(b, window, span)
        key = (b, window, span)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(b, window, span)
            self._graphs[key] = graph
        graph.graph.replay()
        return graph.outputs

    def _capture(self, b: int, window: int, span: int) -> _Graph:
        """Warm up on a side stream, then capture (both compute exactly this step's inputs),
        holding ``_device_lock``: another thread's device work during a capture fails it."""
        with self._device_lock:
            return self._capture_locked(b, window, span)

    def _capture_locked(self, b: int, window: int, span: int) -> _Graph:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_forward(b, window, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = self._decode_forward(b, window, span)
        self.graphs_captured += 1
        return _Graph(graph, outputs)

    # ----------------------------------------------------------------- prefill and decode

    def _prefill(self, rows: list[_Row]) -> None:
        """Prompts of ``rows`` into cache rows ``[n, n + k)``; sample each row's first token."""
        self._settle()
        self._counts["prefill_batches"] += 1
        self._counts["max_prefill_batch"] = max(self._counts["max_prefill_batch"], len(rows))
        start, k = len(self._rows), len(rows)
        busy = {s for s in self._slot if s >= 0}
        slots: list[int] = []
        for row in rows:
            slot = -1 if row.adapter is None else self._pool.acquire(cast(LoadedAdapter, row.adapter), busy)
            if slot >= 0:
                busy.add(slot)
            slots.append(slot)
            row.generator = torch.Generator(device=self.device)
            if row.req.seed is not None:
                row.generator.manual_seed(row.req.seed)
            else:
                row.generator.seed()
        lengths = [len(row.req.input_ids) for row in rows]
        width = max(lengths)
        ids = torch.zeros(k, width, dtype=torch.long)
        for j, row in enumerate(rows):
            ids[j, : lengths[j]] = torch.tensor(row.req.input_ids, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(width, device=self.device)[None, :].expand(k, width)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        x = self._embed(ids)
        cos, sin = self._rotary(x, positions)
        for i, layer in enumerate(self._fused):
            h, _ = ops.rms_norm_torch(x, layer.input_norm, self._eps)
            qkv = self._project_seq(layer.qkv, h, slot_t)
            q, kk, v = ops.qk_heads_torch(
                qkv, layer.q_norm, layer.k_norm, self._eps, cos, sin, self._heads, self._kv_heads
            )
            self._k[i, start : start + k, :, :width] = kk
            self._v[i, start : start + k, :, :width] = v
            # Right padding: a real query never sees a padded key under the causal mask.
            o = F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=self._scale, enable_gqa=True)
            x = x + self._project_seq(layer.o, o.transpose(1, 2).reshape(k, width, -1), slot_t)
            h, _ = ops.rms_norm_torch(x, layer.post_norm, self._eps)
            act = ops.silu_mul_torch(self._project_seq(layer.gate_up, h, slot_t))
            x = x + self._project_seq(layer.down, act, slot_t)
        last = x[torch.arange(k, device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits, greedy, packed = self._greedy_outputs(self._unembed(last, slot_t))
        for j, row in enumerate(rows):
            if row.req.logprob_start_len is not None:
                self._static_prompt_logprobs(row, x[j, : lengths[j]], slot_t[j])
        tokens, values, tops = self._choose(rows, logits, greedy, packed)
        survivors: list[int] = []
        for j, row in enumerate(rows):
            if row.max_new_tokens == 0:
                self._finish(row, Finish("length"))
            elif not self._record(row, tokens[j], values[j], tops[j]):
                survivors.append(j)
        # Append every admitted row, then drop the finished ones (compacting the cache).
        self._rows.extend(rows)
        self._pos.extend(lengths)
        self._slot.extend(slots)
        self._pending.extend(tokens)
        if start > 0 and survivors:
            self._counts["prefill_joins"] += 1
        keep = list(range(start)) + [start + j for j in survivors]
        if len(keep) < len(self._rows):
            self._retain(keep)

    def _static_prompt_logprobs(self, row: _Row, hidden: torch.Tensor, slot: torch.Tensor) -> None:
        """Logprobs of ``input_ids[start + 1:]`` from the row's hidden states (n, H)."""
        from services.sampler.engine import PROMPT_LOGPROB_CHUNK, _top

        ids = row.req.input_ids
        start = row.req.logprob_start_len or 0
        values: list[float | None] = [None]
        tops: list[TopK | None] = [None]
        for lo in range(start, len(ids) - 1, PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, len(ids) - 1)
            logits = self._unembed(hidden[lo:hi].contiguous(), slot.expand(hi - lo).contiguous())  # (c, V)
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(ids[lo + 1 : hi + 1], dtype=torch.long, device=self.device)
            values.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
            if row.req.top_logprobs_num:
                tops.extend(_top(logprobs, row.req.top_logprobs_num))
        row.input_logprobs = values
        row.input_top = tops if row.req.top_logprobs_num else []

    def _decode_step(self) -> None:
        """Read one step of the running rows, first launching the next one where it may run ahead."""
        step = self._ahead if self._ahead is not None else self._launch(after=None)
        self._ahead = self._launch(after=step) if self._may_look_ahead(step) else None
        self._process(step)

    def _may_look_ahead(self, step: _Step) -> bool:
        """Whether the step after ``step`` may run before ``step`` is read (module docstring):
        the same rows, no request waiting that could join now (a full batch admits none until a
        row ends, which only reading ``step`` tells), a free cache column for every row, and some
        row that does not reach its ``max_new_tokens`` with ``step``'s token."""
        return (
            self.config.decode_lookahead
            and step.index == list(range(step.chosen.shape[0]))  # ``index`` follows the running rows
            and (not self._waiting or len(self._rows) >= self.config.max_batch_size)
            and max(self._pos) + 1 < self._context
            and any(len(row.output_ids) + 1 < row.max_new_tokens for row in self._rows)
        )

    def _launch(self, after: _Step | None) -> _Step:
        """Launch a decode step of the running rows: from the host's lists, or, ``after`` a step not
        read yet, from its chosen tokens on the device at every position plus one."""
        n = len(self._rows)
        self._counts["decode_steps"] += 1
        self._counts["max_decode_batch"] = max(self._counts["max_decode_batch"], n)
        b = _bucket(n, self._batch_buckets)
        if after is None:
            window = _bucket(max(self._pos) + 1, self._window_buckets)
            host = self._host_inputs
            host[:, n:] = 0
            host[2, n:] = -1
            host[0, :n] = torch.tensor(self._pending, dtype=torch.long)
            host[1, :n] = torch.tensor(self._pos, dtype=torch.long)
            host[2, :n] = torch.tensor(self._slot, dtype=torch.long)
            # whole buffers: pinned and contiguous on both sides, so the copy does not wait for the
            # stream (the previous from-host copy is done: its step was read since)
            self._inputs.copy_(host, non_blocking=True)
        else:  # the inputs of ``after`` are still in place for rows [0, b): no host copy
            self._counts["lookahead_steps"] += 1
            window = _bucket(max(self._pos) + 2, self._window_buckets)
            self._inputs[0, :n].copy_(after.chosen)
            self._inputs[1, :n].add_(1)
        logits, greedy, packed = self._step_outputs(b, window, self.slot_span(self._slot))
        return self._stage(self._rows, logits[:n], greedy[:n], packed[:, :n])

    def _process(self, step: _Step) -> None:
        """Record ``step``'s token of every running row; rows that finished leave the batch."""
        tokens, values, tops = self._read(step)
        n = len(self._rows)
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            self._pos[i] += 1
            self._pending[i] = tokens[i]
            if not self._record(row, tokens[i], values[i], tops[i]):
                keep.append(i)
        if len(keep) < n:
            self._retain(keep)

    def _choose(
        self, rows: list[_Row], logits: torch.Tensor, greedy: torch.Tensor, packed: torch.Tensor
    ) -> tuple[list[int], list[float], list[list[TopK]]]:
        """Next token, its logprob and top logprobs of every row (``_stage``, then ``_read``)."""
        return self._read(self._stage(rows, logits, greedy, packed))

    def _stage(self, rows: list[_Row], logits: torch.Tensor, greedy: torch.Tensor, packed: torch.Tensor) -> _Step:
        """Choose every row's next token on the device and start copying (token, logprob) rows
        to the host; top logprobs, where a row asks for them, are read here (a second sync).

        ``packed`` (2, n): the greedy tokens and their logprobs; a batch of greedy rows without
        top logprobs copies only that, the graph's own output."""
        sampled = [i for i, row in enumerate(rows) if not is_greedy(row.req.temperature, row.req.top_k)]
        wanted = [i for i, row in enumerate(rows) if row.req.top_logprobs_num]
        logprobs = torch.log_softmax(logits, dim=-1) if sampled or wanted else None
        chosen = greedy
        if sampled and logprobs is not None:
            chosen = greedy.clone()
            for i in sampled:
                req = rows[i].req
                chosen[i] = choose_token_tensor(
                    logits[i],
                    temperature=req.temperature,
                    top_k=req.top_k,
                    top_p=req.top_p,
                    min_p=req.min_p,
                    generator=rows[i].generator,
                )
            picked = logprobs.gather(1, chosen[:, None])[:, 0]
            packed = torch.stack([chosen.double(), picked.double()])
        tops: list[list[TopK]] = [[] for _ in rows]
        if wanted and logprobs is not None:
            k = max(rows[i].req.top_logprobs_num for i in wanted)
            top_v, top_i = torch.topk(logprobs[wanted], k, dim=-1)
            for i, v, t in zip(wanted, top_v.tolist(), top_i.tolist(), strict=True):
                n = rows[i].req.top_logprobs_num
                tops[i] = [list(zip(v[:n], t[:n], strict=True))]
        which, self._next_output = self._next_output, self._next_output ^ 1  # at most two unread
        host = self._host_outputs[which][: 2 * len(rows)].view(2, len(rows))
        ready = None if self._copied is None else self._copied[which]
        host.copy_(packed.contiguous(), non_blocking=ready is not None)  # the graph's output is [2, b]
        if ready is not None:
            ready.record()
        return _Step(list(range(len(rows))), chosen, host, ready, tops)

    @staticmethod
    def _read(step: _Step) -> tuple[list[int], list[float], list[list[TopK]]]:
        """The (token, logprob, tops) of each running row from ``step``: waits for its copy only,
        not for a step launched after it."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = [int(t) for t in step.host[0].tolist()]
        values = step.host[1].tolist()
        return (
            [tokens[i] for i in step.index],
            [values[i] for i in step.index],
            [step.tops[i] for i in step.index],
        )
