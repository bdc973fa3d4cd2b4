"""The CPU sampling engine: a Hugging Face causal LM, continuous batching, multi-LoRA.

``HFEngine`` implements ``interface.Engine`` with an fp32 ``AutoModelForCausalLM`` from a
local directory and ``lora.py``'s per-row adapters.

Scheduling.  ``generate`` validates and enqueues one row per sequence and awaits its
future.  One worker thread owns the model's torch work (and the event loop never blocks);
an adapter handed over from another process's memory is opened, validated and copied by the
thread of its request meanwhile, outside any CUDA graph capture (``_device_lock``), and
reaches the worker's pool slots only at admission.  Each iteration the worker (1) drops
rows whose caller went away, (2) admits waiting rows up to ``max_batch_size`` and prefills
them together (left-padded, each with its own adapter), sampling their first token, (3)
runs one decode step for every running row with the KV cache, and (4) retires finished
rows.  New requests therefore join a running batch at the next step boundary instead of
waiting for it to drain.

Numerics.  Reported logprobs are ``log_softmax`` of the fp32 logits at temperature 1,
the same quantity a trainer forward computes; sampling applies temperature/top-k/top-p
separately (``sampling.py``).  Prompt logprobs follow SGLang: entries align with
``input_ids[logprob_start_len:]`` and the first one is ``None``.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from services.sampler import handover
from services.sampler.batch import KVBatch, left_pad
from services.sampler.config import SamplerConfig
from services.sampler.interface import (
    EngineInfo,
    RequestError,
    SequenceRequest,
    SequenceResult,
    TopK,
)
from services.sampler.lora import (
    TENSOR_SOURCE,
    AdapterError,
    AdapterRegistry,
    LoadedAdapter,
    adapter_from_tensors,
    install_lora,
    read_adapter,
)
from services.sampler.sampling import Finish, choose_token, finish_reason, trim_text
from services.sampler.wire import EngineCounters

PROMPT_LOGPROB_CHUNK = 256
"""Prompt positions pushed through the unembedding at once (bounds the (T, V) logits)."""


@dataclass(slots=True, eq=False)
class _Row:
    """Mutable decoding state of one sequence; owned by the worker thread once admitted."""

    req: SequenceRequest
    max_new_tokens: int
    adapter: LoadedAdapter | None
    stop_ids: frozenset[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[SequenceResult]
    started: float
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopK] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopK | None] = field(default_factory=list)

    def resolve(self, result: SequenceResult | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result)
        except RuntimeError:  # the caller's event loop is gone; nobody is waiting
            pass


def _settle(future: asyncio.Future[SequenceResult], result: SequenceResult | BaseException) -> None:
    if future.done():  # the caller went away
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _top(logprobs: torch.Tensor, k: int) -> list[TopK]:
    """Top-``k`` ``(logprob, token)`` pairs of each row of ``logprobs`` (N, V)."""
    values, index = torch.topk(logprobs, k, dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), index.tolist(), strict=True)]


class HFEngine:
    """``Engine`` over transformers + PEFT-format adapters, fp32 on CPU."""

    def __init__(self, config: SamplerConfig) -> None:
        model_dir = Path(config.model_path)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"no Hugging Face model at {model_dir} (config.json missing)")
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = self._load_model(model_dir)
        model.eval().requires_grad_(False)
        self._check_architecture(model)
        self.model = model
        self._routing, bases = install_lora(model)
        self._bases = bases
        self._decoder: nn.Module = model.get_decoder()
        self._lm_head = cast(nn.Module, model.get_output_embeddings())

        model_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        context = config.context_length or model_context
        if context <= 1 or (model_context and context > model_context):
            raise ValueError(
                f"context_length {context} is invalid for a model with {model_context} positions"
            )
        eos: set[int] = set()
        for source in (
            model.generation_config.eos_token_id,
            model.config.eos_token_id,
            self.tokenizer.eos_token_id,
        ):
            eos.update([source] if isinstance(source, int) else list(source or []))
        self.info = EngineInfo(
            model_path=str(model_dir),
            context_length=context,
            vocab_size=int(model.config.vocab_size),
            max_batch_size=config.max_batch_size,
            max_loaded_loras=config.max_loaded_loras,
            max_lora_rank=config.max_lora_rank,
            lora_target_modules=sorted({name.rsplit(".", 1)[-1] for name in bases}),
            eos_token_ids=sorted(eos),
        )
        self._lora_bases = bases
        loader = functools.partial(read_adapter, bases=bases, max_rank=config.max_lora_rank)
        self._registry = AdapterRegistry(loader, config.max_loaded_loras)

        # Held by device work that must not overlap another thread's: a CUDA graph capture
        # (StaticCacheEngine._capture) and a handed-over adapter's load.
        self._device_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._admitting = True
        self._closed = False
        self._rows: list[_Row] = []  # running rows, in KV-batch order (worker thread only)
        self._kv: KVBatch | None = None
        self._counts = {f.name: 0 for f in msgspec.structs.fields(EngineCounters)}
        self._prepare()
        self._worker = threading.Thread(target=self._run, name="sampler-engine", daemon=True)
        self._worker.start()

    def _load_model(self, model_dir: Path) -> PreTrainedModel:
        """The base model: fp32 on the CPU here (``StaticCacheEngine`` overrides it)."""
        return cast(
            PreTrainedModel,
            AutoModelForCausalLM.from_pretrained(
                model_dir,
                dtype=torch.float32,
                attn_implementation=self.config.attn_implementation,
                local_files_only=True,
            ),
        )

    def _prepare(self) -> None:
        """Hook run once the model and registry exist, before the worker thread starts."""

    # ----------------------------------------------------------------- public API

    async def generate(self, requests: Sequence[SequenceRequest]) -> list[SequenceResult]:
        budgets = [self._validate(req) for req in requests]
        adapters: dict[str, LoadedAdapter] = {}
        for name in {r.lora_name for r in requests if r.lora_name is not None}:
            try:
                adapters[name] = await asyncio.to_thread(self._registry.get, name)
            except AdapterError as exc:
                raise RequestError(str(exc)) from exc
        loop = asyncio.get_running_loop()
        rows = [
            _Row(
                req=req,
                max_new_tokens=budget,
                adapter=adapters[req.lora_name] if req.lora_name is not None else None,
                stop_ids=frozenset(req.stop_token_ids) | frozenset(self.info.eos_token_ids),
                loop=loop,
                future=loop.create_future(),
                started=time.perf_counter(),
            )
            for req, budget in zip(requests, budgets, strict=True)
        ]
        with self._cond:
            if self._closed:
                raise RuntimeError("the sampling engine is closed")
            self._waiting.extend(rows)
            self._cond.notify_all()
        try:
            return list(await asyncio.gather(*(row.future for row in rows)))
        finally:
            for row in rows:  # on cancellation the worker sees done futures and drops the rows
                if not row.future.done():
                    row.future.cancel()

    async def load_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        await asyncio.to_thread(self._registry.register, name, path, pinned=pinned)

    async def load_adapter_tensors(
        self, name: str, config: dict[str, Any], payload: str, *, pinned: bool = False
    ) -> None:
        def load() -> LoadedAdapter:
            try:
                tensors = handover.decode(payload)
            except handover.HandoverError as exc:
                raise AdapterError(f"adapter {name!r}: {exc}") from exc
            return adapter_from_tensors(
                name, TENSOR_SOURCE, config, tensors, self._lora_bases, self.config.max_lora_rank
            )  # copies: the sender's memory is not kept

        def load_beside_the_worker() -> LoadedAdapter:
            # It touches the device (CUDA IPC, copies, one finiteness read) from this thread while
            # the worker goes on decoding: never during a graph capture (``_device_lock``).
            with self._device_lock:
                if self._closed:
                    raise AdapterError("the sampling engine is closed")
                return load()

        await asyncio.to_thread(
            self._registry.register_loaded, name, load_beside_the_worker, TENSOR_SOURCE, pinned=pinned
        )

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self._registry.unregister, name)

    def adapters(self) -> dict[str, str]:
        return self._registry.paths()

    def resident_adapters(self) -> list[str]:
        return self._registry.resident()

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self._decode([t]) for t in token_ids]

    def _decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return cast(str, self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def counters(self) -> EngineCounters:
        counts = dict(self._counts)
        counts["adapter_loads"] = self._registry.loads
        counts["adapter_evictions"] = self._registry.evictions
        with self._cond:
            counts["running_sequences"] = len(self._rows) + len(self._waiting)
        return EngineCounters(**counts)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
        for row in [*self._waiting, *self._rows]:
            row.resolve(RuntimeError("the sampling engine was closed"))
        self._waiting.clear()
        self._rows, self._kv = [], None

    # Admission control, for tests and benchmarks that need a deterministic batch.

    def hold_admission(self) -> None:
        """Queue new requests without starting them (running rows continue)."""
        with self._cond:
            self._admitting = False

    def release_admission(self) -> None:
        with self._cond:
            self._admitting = True
            self._cond.notify_all()

    def wait_until_waiting(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` rows are queued; ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiting) >= count, timeout)

    # ----------------------------------------------------------------- validation

    def _validate(self, req: SequenceRequest) -> int:
        """Check ``req`` against the model; returns its resolved ``max_new_tokens``."""
        info = self.info
        n = len(req.input_ids)
        if n == 0:
            raise RequestError("input_ids must not be empty")
        bad = [t for t in req.input_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestError(
                f"input_ids contain token ids outside the vocabulary [0, {info.vocab_size}): {bad[:8]}"
            )
        if req.max_new_tokens is not None and req.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {req.max_new_tokens}")
        budget = max(info.context_length - n, 0) if req.max_new_tokens is None else req.max_new_tokens
        if n + budget > info.context_length:
            raise RequestError(
                f"prompt length ({n} tokens) + max_new_tokens ({budget}) = "
                f"{n + budget} exceeds the context length ({info.context_length})"
            )
        if req.logprob_start_len is not None and not 0 <= req.logprob_start_len < n:
            raise RequestError(
                f"logprob_start_len ({req.logprob_start_len}) must be less than the number of input tokens ({n})"
            )
        if not 0 <= req.top_logprobs_num <= info.vocab_size:
            raise RequestError(
                f"top_logprobs_num must be in [0, {info.vocab_size}], got {req.top_logprobs_num}"
            )
        if req.temperature < 0 or not 0 < req.top_p <= 1 or not 0 <= req.min_p <= 1:
            raise RequestError("temperature must be >= 0, top_p in (0, 1] and min_p in [0, 1]")
        stop_bad = [t for t in req.stop_token_ids if not 0 <= t < info.vocab_size]
        if stop_bad:
            raise RequestError(f"stop_token_ids outside the vocabulary: {stop_bad[:8]}")
        return budget

    @staticmethod
    def _check_architecture(model: PreTrainedModel) -> None:
        """Refuse models whose logits are not ``lm_head(decoder(x))`` (softcapping, scaling)."""
        probe = torch.tensor([[1, 2, 3]], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            full = model(input_ids=probe).logits
            lm_head = cast(nn.Module, model.get_output_embeddings())
            split = lm_head(model.get_decoder()(input_ids=probe).last_hidden_state)
        tol = 1e-5 if full.dtype == torch.float32 else 2e-2
        if not torch.allclose(full.float(), split.float(), atol=tol, rtol=tol):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits; the CPU sampler does not support it"
            )
        layers = DynamicCache(config=model.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise ValueError(f"{type(model).__name__} uses sliding-window or linear attention; not supported")

    # ----------------------------------------------------------------- worker thread

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._rows or (self._admitting and self._waiting))
                if self._closed:
                    return
                admitted = self._take_admissions() if self._admitting else []
            try:
                with torch.inference_mode():
                    self._drop_abandoned()
                    if admitted:
                        self._prefill(admitted)
                    if self._rows:
                        self._decode_step()
            except Exception as exc:  # a failed step fails its rows; the engine keeps serving
                for row in {*admitted, *self._rows}:
                    row.resolve(RuntimeError(f"generation failed: {type(exc).__name__}: {exc}"))
                self._reset_batch()

    def _take_admissions(self) -> list[_Row]:
        """Waiting rows to start now (called under ``self._cond``): up to ``max_batch_size``."""
        admitted: list[_Row] = []
        while self._waiting and len(self._rows) + len(admitted) < self.config.max_batch_size:
            row = self._waiting.popleft()
            if not row.future.done():
                admitted.append(row)
        return admitted

    def _reset_batch(self) -> None:
        """Forget the running batch (after a failed step has failed its rows)."""
        self._rows, self._kv = [], None

    def _drop_abandoned(self) -> None:
        keep = [i for i, row in enumerate(self._rows) if not row.future.done()]
        if len(keep) < len(self._rows):
            self._retain(keep)

    def _retain(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        self._kv = self._kv.select(keep) if keep and self._kv is not None else None

    def _prefill(self, rows: list[_Row]) -> None:
        """Run the prompts of ``rows`` together, record prompt logprobs, sample first tokens."""
        self._counts["prefill_batches"] += 1
        self._counts["max_prefill_batch"] = max(self._counts["max_prefill_batch"], len(rows))
        for row in rows:
            row.generator = torch.Generator()
            if row.req.seed is not None:
                row.generator.manual_seed(row.req.seed)
            else:
                row.generator.seed()
        ids, mask, positions = left_pad([row.req.input_ids for row in rows])
        cache = DynamicCache(config=self.model.config)
        with self._routing.routed([row.adapter for row in rows]):
            hidden = self._decoder(
                input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
            ).last_hidden_state  # (B, L, H)
            logits = self._lm_head(hidden[:, -1:, :])[:, 0, :].float()  # (B, V)
        for j, row in enumerate(rows):
            if row.req.logprob_start_len is not None:
                self._prompt_logprobs(row, hidden[j])
        logprobs = torch.log_softmax(logits, dim=-1)
        survivors: list[int] = []
        pending: list[int] = []
        for j, row in enumerate(rows):
            if row.max_new_tokens == 0:
                self._finish(row, Finish("length"))
            elif not self._accept(row, logits[j], logprobs[j]):
                survivors.append(j)
            pending.append(row.output_ids[-1] if row.output_ids else 0)
        if not survivors:
            return
        fresh = KVBatch(
            cache=cache,
            mask=mask,
            positions=torch.tensor([len(row.req.input_ids) for row in rows], dtype=torch.long),
            pending=torch.tensor(pending, dtype=torch.long),
        ).select(survivors)
        if self._kv is not None:
            self._counts["prefill_joins"] += 1
        self._kv = KVBatch.merge(self._kv, fresh)
        self._rows.extend(rows[j] for j in survivors)

    def _prompt_logprobs(self, row: _Row, hidden: torch.Tensor) -> None:
        """Logprobs of ``input_ids[start + 1:]`` from the row's prefill hidden states (L, H)."""
        ids = row.req.input_ids
        start = row.req.logprob_start_len or 0
        offset = hidden.shape[0] - len(ids)  # left padding of this row
        values: list[float | None] = [None]
        tops: list[TopK | None] = [None]
        # Hidden state at prompt index i predicts token i + 1.
        for lo in range(start, len(ids) - 1, PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, len(ids) - 1)
            with self._routing.routed([row.adapter]):
                logits = self._lm_head(hidden[None, offset + lo : offset + hi, :])[0].float()  # (c, V)
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(ids[lo + 1 : hi + 1], dtype=torch.long)
            values.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
            if row.req.top_logprobs_num:
                tops.extend(_top(logprobs, row.req.top_logprobs_num))
        row.input_logprobs = values
        row.input_top = tops if row.req.top_logprobs_num else []

    def _decode_step(self) -> None:
        """Feed every running row its pending token and sample the next one."""
        kv = self._kv
        assert kv is not None
        self._counts["decode_steps"] += 1
        self._counts["max_decode_batch"] = max(self._counts["max_decode_batch"], kv.size)
        mask = torch.cat([kv.mask, torch.ones(kv.size, 1, dtype=torch.long)], dim=1)
        with self._routing.routed([row.adapter for row in self._rows]):
            hidden = self._decoder(
                input_ids=kv.pending[:, None],
                attention_mask=mask,
                position_ids=kv.positions[:, None],
                cache=kv.cache,
                use_cache=True,
            ).last_hidden_state  # (B, 1, H)
            logits = self._lm_head(hidden)[:, 0, :].float()  # (B, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        kv.mask = mask
        kv.positions = kv.positions + 1
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            if not self._accept(row, logits[i], logprobs[i]):
                keep.append(i)
        kv.pending = torch.tensor([row.output_ids[-1] for row in self._rows], dtype=torch.long)
        if len(keep) < len(self._rows):
            self._retain(keep)

    def _accept(self, row: _Row, logits: torch.Tensor, logprobs: torch.Tensor) -> bool:
        """Sample one token for ``row``; finish it if a stop condition holds. True when finished."""
        req = row.req
        token = choose_token(
            logits,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            generator=row.generator,
        )
        top = _top(logprobs[None], req.top_logprobs_num) if req.top_logprobs_num else []
        return self._record(row, token, float(logprobs[token]), top)

    def _record(self, row: _Row, token: int, logprob: float, top: list[TopK]) -> bool:
        """Append one sampled token to ``row``; finish it if a stop condition holds. True when finished."""
        req = row.req
        row.output_ids.append(token)
        row.output_logprobs.append(logprob)
        row.output_top.extend(top)
        self._counts["generated_tokens"] += 1
        finish = finish_reason(
            row.output_ids,
            max_new_tokens=row.max_new_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=row.stop_ids,
            stop_strs=req.stop_strs,
            decode=self._decode,
        )
        if finish is None:
            return False
        self._finish(row, finish)
        return True

    def _finish(self, row: _Row, finish: Finish) -> None:
        req = row.req
        text_ids = row.output_ids
        if isinstance(finish.matched, int) and not req.no_stop_trim:
            text_ids = text_ids[:-1]  # SGLang leaves the matched stop token out of the text
        text = self._decode(text_ids, skip_special_tokens=req.skip_special_tokens)
        self._counts["finished_sequences"] += 1
        row.resolve(
            SequenceResult(
                text=trim_text(text, finish, req.no_stop_trim),
                output_ids=list(row.output_ids),
                finish_kind=finish.kind,
                finish_matched=finish.matched,
                prompt_tokens=len(req.input_ids),
                output_logprobs=row.output_logprobs,
                output_top_logprobs=row.output_top,
                input_logprobs=row.input_logprobs,
                input_top_logprobs=row.input_top,
                latency_s=time.perf_counter() - row.started,
            )
        )
