"""Multi-adapter LoRA for inference: PEFT directories in, per-row adapters in one batch.

Every targeted ``nn.Linear`` of the base model is wrapped in a ``LoRALinear`` that
computes, for each row ``i`` of the batch with adapter ``a(i)``::

    y_i = W x_i + s_a · B_a (A_a x_i)        A_a: (r, in), B_a: (out, r), s_a = alpha / r

(``alpha / sqrt(r)`` with rsLoRA).  Rows without an adapter get the base model.  The
wrappers share one ``LoRARouting`` that the engine sets before every forward call: a
list of ``(adapter, row indices)`` groups, so one forward serves many adapters and the
LoRA matmuls run once per distinct adapter, never per row.  This is exactly PEFT's
``base(x) + lora_B(lora_A(x)) * scaling`` (dropout is off at inference).

``AdapterRegistry`` maps names to directories and keeps at most ``capacity`` adapters
resident, evicting the least recently used unpinned one.  An evicted adapter stays
registered and is reloaded from its directory on its next use; one loaded from tensors
(``/load_lora_adapter_from_tensors``: it has no directory, ``TENSOR_SOURCE``) is forgotten
when evicted, and its next use answers "not loaded", so the caller loads it again.  Rows that are already
decoding hold their adapter object, so an eviction or unload never disturbs them.

Why not PEFT itself: its mixed-adapter batches (``adapter_names=`` per forward) fix the
adapter of every row for one call, while continuous batching changes the rows between
decode steps and admits new adapters mid-batch; and PEFT keeps every loaded adapter in the
model, with no bound and no eviction.  PEFT is therefore a test dependency only: the
sampler's tests check this module against PEFT's own forward on the same directories.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)
TENSOR_SOURCE = "__tensor__"
"""The path an adapter loaded from tensors reports (SGLang's word for it)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT key layout: "base_model.model.<module>.lora_A[.<adapter name>].weight".
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# PEFT also saves the base weight of a targeted lm_head/embedding ("save_embedding_layers").
_BASE_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.base_layer\.weight$")


class AdapterError(ValueError):
    """An adapter cannot be loaded or used (bad directory, unsupported config, rank too large)."""


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One module's low-rank update; ``a``: (r, in), ``b``: (out, r)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True, slots=True, eq=False)
class LoadedAdapter:
    """An adapter in memory, keyed by HF module name (``model.layers.0.self_attn.q_proj``)."""

    name: str
    path: str
    rank: int
    modules: dict[str, LoRAWeights]


class LoRARouting:
    """Which rows of the next forward use which adapter; shared by all ``LoRALinear``s."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoadedAdapter, torch.Tensor | None]] = []

    def route(self, row_adapters: Sequence[LoadedAdapter | None]) -> None:
        """Set the adapter of every row of the next forward (``None`` = base model)."""
        rows_by_adapter: dict[int, tuple[LoadedAdapter, list[int]]] = {}
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                rows_by_adapter.setdefault(id(adapter), (adapter, []))[1].append(row)
        groups: list[tuple[LoadedAdapter, torch.Tensor | None]] = []
        for adapter, rows in rows_by_adapter.values():
            # A group covering the whole batch needs no gather/scatter.
            index = None if len(rows) == len(row_adapters) else torch.tensor(rows, dtype=torch.long)
            groups.append((adapter, index))
        self.groups = groups

    @contextmanager
    def routed(self, row_adapters: Sequence[LoadedAdapter | None]) -> Iterator[None]:
        """Route for the duration of one forward call, then fall back to the base model."""
        self.route(row_adapters)
        try:
            yield
        finally:
            self.groups = []


class LoRALinear(nn.Module):
    """``base`` plus the routed adapters' low-rank updates (see the module docstring)."""

    def __init__(self, base: nn.Linear, name: str, routing: LoRARouting) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.routing = routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (B, T, out)
        for adapter, rows in self.routing.groups:
            w = adapter.modules.get(self.name)
            if w is None:
                continue
            if rows is None:
                y = y + (x @ w.a.T) @ w.b.T * w.scaling  # (B, T, r) -> (B, T, out)
            else:
                delta = (x[rows] @ w.a.T) @ w.b.T * w.scaling  # (b, T, out)
                y = y.index_add(0, rows, delta)
        return y


def install_lora(model: nn.Module) -> tuple[LoRARouting, dict[str, nn.Linear]]:
    """Wrap every ``nn.Linear`` named like a ``TARGET_MODULES`` entry, in place.

    Returns:
        The routing shared by the wrappers and ``{module name: wrapped base linear}``.
    """
    routing = LoRARouting()
    bases: dict[str, nn.Linear] = {}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, name, routing))
        bases[name] = module
    return routing, bases


def _pattern_value(patterns: dict[str, float], module: str) -> float | None:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: a key matches a module-name suffix."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return float(value)
    return None


def read_adapter(name: str, path: str, bases: dict[str, nn.Linear], max_rank: int) -> LoadedAdapter:
    """Load and validate a PEFT LoRA directory against the model's target modules.

    Raises:
        AdapterError: missing files, a non-LoRA or unsupported PEFT config (DoRA, LoRA
            bias, ``modules_to_save``, embedding adapters), tensors for modules the
            model does not have or that are not LoRA targets, saved base weights that
            differ from the model's, shape mismatches, or a rank above ``max_rank``.
    """
    root = Path(path)
    config_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not root.is_dir():
        raise AdapterError(f"adapter directory {path!r} does not exist")
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"adapter directory {path!r} needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file), device="cpu")
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read adapter {path!r}: {exc}") from exc
    return adapter_from_tensors(name, path, cfg, tensors, bases, max_rank)


def adapter_from_tensors(
    name: str,
    path: str,
    cfg: dict[str, object],
    tensors: dict[str, torch.Tensor],
    bases: dict[str, nn.Linear],
    max_rank: int,
) -> LoadedAdapter:
    """Validate a PEFT LoRA (its ``adapter_config.json`` content and its tensors, on any device)
    and copy it to the host in fp32; ``path`` names where it came from in messages. Raises ``AdapterError`` as ``read_adapter``."""
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {path!r}: its config must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {path!r} has peft_type {cfg.get('peft_type')!r}; only LORA is supported")
    for flag in ("use_dora", "lora_bias"):
        if cfg.get(flag):
            raise AdapterError(f"adapter {path!r} sets {flag}, which is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter {path!r} has modules_to_save, which is not supported")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is not None:
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
            continue
        base = _BASE_KEY.match(key)
        if base is not None and base["module"] in bases:
            # Only a copy of the model's own weight is acceptable (no resized vocabulary).
            weight = bases[base["module"]].weight
            if not torch.equal(tensor.to(device=weight.device, dtype=weight.dtype), weight):
                raise AdapterError(f"adapter {path!r} replaces the base weight of {base['module']!r}")
            continue
        raise AdapterError(f"adapter {path!r} has an unsupported tensor {key!r}")
    if not pairs:
        raise AdapterError(f"adapter {path!r} has no LoRA tensors")

    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))  # type: ignore[arg-type]
    rank_pattern: dict[str, float] = cfg.get("rank_pattern") or {}  # type: ignore[assignment]
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}  # type: ignore[assignment]
    modules: dict[str, LoRAWeights] = {}
    max_seen = 0
    for module, ab in sorted(pairs.items()):
        if module not in bases:
            raise AdapterError(
                f"adapter {path!r} targets {module!r}, which is not a supported LoRA target of this model "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {path!r} lacks lora_A or lora_B for {module!r}")
        # the adapter's own fp32 copies, freshly allocated whatever the source (a file's mmap,
        # another process's memory): the same values compute the same results. They live on the
        # host, except tensors that arrive on the engine's kind of device (a CUDA handover into
        # the CUDA engine), which stay there: no host round trip on the way into its LoRA pool.
        engine_device = bases[module].weight.device
        on_device = engine_device.type != "cpu" and ab["A"].device.type == engine_device.type
        home = engine_device if on_device else torch.device("cpu")
        a = ab["A"].to(home, torch.float32, copy=True)
        b = ab["B"].to(home, torch.float32, copy=True)
        in_features, out_features = bases[module].in_features, bases[module].out_features
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterError(
                f"adapter {path!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"expected ({rank}, {in_features}) and ({out_features}, {rank})"
            )
        declared = _pattern_value(rank_pattern, module)
        if declared is not None and int(declared) != rank:
            raise AdapterError(
                f"adapter {path!r}: {module} has rank {rank}, rank_pattern says {int(declared)}"
            )
        if rank > max_rank:
            raise AdapterError(f"adapter {path!r} has rank {rank}, above max_lora_rank {max_rank}")
        mod_alpha = _pattern_value(alpha_pattern, module) or alpha
        scaling = mod_alpha / math.sqrt(rank) if cfg.get("use_rslora") else mod_alpha / rank
        modules[module] = LoRAWeights(a=a, b=b, scaling=scaling)
        max_seen = max(max_seen, rank)
    # every module's finiteness in one read back to the host (a read per module stalls a device
    # load hundreds of times)
    finite = torch.stack([torch.isfinite(w.a).all() & torch.isfinite(w.b).all() for w in modules.values()])
    for module, ok in zip(modules, finite.tolist(), strict=True):
        if not ok:
            raise AdapterError(f"adapter {path!r}: {module} has non-finite values (NaN or inf)")
    return LoadedAdapter(name=name, path=str(path), rank=max_seen, modules=modules)


@dataclass(frozen=True, slots=True)
class PoolGroup:
    """The slots of the modules that read one input (q/k/v, gate/up, or one module alone).

    ``a``: (slots, members * rank, in), member ``j``'s ``A`` in rows ``[j * rank, (j + 1) * rank)``;
    ``b``: (slots, out, rank), member ``j``'s ``B`` (scaling folded in) in rows
    ``[bounds[j], bounds[j + 1])``, the member's output columns in the fused projection.
    """

    members: tuple[str, ...]
    bounds: list[int]
    a: torch.Tensor
    b: torch.Tensor


class LoRAPool:
    """Every adapter module of ``slots`` adapters, per fused group of target modules.

    Slot ``s`` of a group holds one adapter's matrices for all the group's members (a smaller
    rank is zero-padded to the pool's rank, a module the adapter lacks is all zero).  A forward
    gives each row a slot (``-1``: none) and each row reads only its own slot's matrices
    (``decode_ops.add_lora``): one tenant's values never enter another tenant's row.
    Non-finite adapters are refused at load (``read_adapter``).
    """

    def __init__(
        self,
        groups: dict[str, tuple[str, ...]],
        bases: dict[str, nn.Linear],
        slots: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.slots = slots
        self.rank = max(16, 1 << (rank - 1).bit_length())  # a power of two, >= 16: kernel tiles
        self.groups: dict[str, PoolGroup] = {}
        for name, members in groups.items():
            linears = [bases[m] for m in members]
            bounds = [0]
            for linear in linears:
                bounds.append(bounds[-1] + linear.out_features)
            self.groups[name] = PoolGroup(
                members=members,
                bounds=bounds,
                a=torch.zeros(
                    slots, len(members) * self.rank, linears[0].in_features, device=device, dtype=dtype
                ),
                b=torch.zeros(slots, bounds[-1], self.rank, device=device, dtype=dtype),
            )
        self.dtype = dtype
        self._owner: list[LoadedAdapter | None] = [None] * slots
        self._used = [0] * slots
        self._clock = 0
        self.loads = 0

    def place_a(self, name: str, storage: torch.Tensor) -> None:
        """Keep group ``name``'s ``A`` in ``storage`` (slots * members * rank, in) from now on:
        rows of a folded projection weight (``static_engine``). Its current values move there."""
        group = self.groups[name]
        a = storage.view(group.a.shape)  # raises unless the sizes match
        a.copy_(group.a)
        self.groups[name] = replace(group, a=a)

    def slot_of(self, adapter: LoadedAdapter) -> int | None:
        for slot, owner in enumerate(self._owner):
            if owner is adapter:
                return slot
        return None

    def acquire(self, adapter: LoadedAdapter, busy: set[int]) -> int:
        """The slot holding ``adapter``, loading it into the lowest empty slot, else the least
        recently used one outside ``busy`` (slots that running rows use).  Raises
        ``RuntimeError`` if none is free. Low slots first keep a step's slot span short (the
        static engine's GEMMs read the ``A`` rows of slots below the highest one in use)."""
        self._clock += 1
        slot = self.slot_of(adapter)
        if slot is None:
            free = [s for s in range(self.slots) if s not in busy]
            if not free:
                raise RuntimeError("every LoRA slot is in use by running rows")
            empty = [s for s in free if self._owner[s] is None]
            slot = min(empty) if empty else min(free, key=lambda s: self._used[s])
            self._load(slot, adapter)
        self._used[slot] = self._clock
        return slot

    def _load(self, slot: int, adapter: LoadedAdapter) -> None:
        r = self.rank
        for group in self.groups.values():
            a, b = group.a[slot], group.b[slot]
            a.zero_()
            b.zero_()
            for j, module in enumerate(group.members):
                w = adapter.modules.get(module)
                if w is None:
                    continue
                rank = w.a.shape[0]
                lo, hi = group.bounds[j], group.bounds[j + 1]
                a[j * r : j * r + rank].copy_(w.a)
                b[lo:hi, :rank].copy_(w.b * w.scaling)
        self._owner[slot] = adapter
        self.loads += 1


@dataclass(slots=True)
class _Entry:
    path: str
    pinned: bool


class AdapterRegistry:
    """Adapter names → directories, with an LRU-bounded set of resident adapters.

    Thread-safe. A registration loads outside the lock, so tenants' adapters load side by side
    (an 8B adapter takes a good part of a second from its files): one never waits for another's.
    Registrations of the same name meanwhile wait for the first and then answer that it is loaded
    (or, if the first failed, load it themselves). A reload after an eviction happens under the
    lock (rare).
    """

    def __init__(self, loader: Callable[[str, str], LoadedAdapter], capacity: int) -> None:
        self._loader = loader
        self._capacity = capacity
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Event] = {}  # name -> set once its registration ends
        self._entries: dict[str, _Entry] = {}
        self._resident: OrderedDict[str, LoadedAdapter] = OrderedDict()  # LRU first
        self.loads = 0
        self.evictions = 0

    def register(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load ``path`` now (to validate it) and serve it under ``name``.

        Raises:
            AdapterError: the name is taken, the adapter is invalid, or every resident
                adapter is pinned.
        """
        self.register_loaded(name, lambda: self._loader(name, path), path, pinned=pinned)

    def register_loaded(
        self, name: str, load: Callable[[], LoadedAdapter], path: str, *, pinned: bool = False
    ) -> None:
        """Serve what ``load`` returns under ``name`` (``path``: where it came from, or
        ``TENSOR_SOURCE``); raises as ``register``."""
        while True:
            with self._lock:
                if name in self._entries:
                    raise AdapterError(
                        f"the LoRA adapter with name {name!r} is already loaded; names are immutable, "
                        "unload it first or use a new name"
                    )
                pending = self._loading.get(name)
                if pending is None:
                    done = self._loading[name] = threading.Event()
                    break
            pending.wait()  # the same name is being loaded: its outcome decides
        try:
            adapter = load()  # outside the lock: other adapters load meanwhile
            with self._lock:
                self._admit(adapter)
                self._entries[name] = _Entry(path=path, pinned=pinned)
        finally:
            with self._lock:
                del self._loading[name]
            done.set()

    def unregister(self, name: str) -> None:
        """Stop serving ``name``; rows already decoding with it finish normally."""
        with self._lock:
            if name not in self._entries:
                raise AdapterError(f"the LoRA adapter with name {name!r} is not loaded")
            del self._entries[name]
            self._resident.pop(name, None)

    def get(self, name: str) -> LoadedAdapter:
        """The resident adapter ``name``, reloading it from its directory if it was evicted."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.path == TENSOR_SOURCE and name not in self._resident:
                del self._entries[name]  # evicted, and it has no directory to come back from
                entry = None
            if entry is None:
                # SGLang's words, which clients match to load the adapter and try again.
                raise AdapterError(
                    f"The following requested LoRA adapters are not loaded: {name} "
                    "(use /load_lora_adapter first)"
                )
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
                return adapter
            try:
                adapter = self._loader(name, entry.path)
            except AdapterError as exc:
                raise AdapterError(f"adapter {name!r} was evicted and cannot be reloaded: {exc}") from exc
            self._admit(adapter)
            return adapter

    def paths(self) -> dict[str, str]:
        with self._lock:
            return {name: entry.path for name, entry in self._entries.items()}

    def resident(self) -> list[str]:
        """Resident adapter names, least recently used first."""
        with self._lock:
            return list(self._resident)

    def _admit(self, adapter: LoadedAdapter) -> None:
        """Make room (evicting LRU unpinned adapters), then insert ``adapter`` as most recent."""
        while len(self._resident) >= self._capacity:
            victim = next(
                (n for n in self._resident if not (n in self._entries and self._entries[n].pinned)), None
            )
            if victim is None:
                raise AdapterError(
                    f"cannot load adapter {adapter.name!r}: all {self._capacity} resident adapters are pinned"
                )
            del self._resident[victim]
            self.evictions += 1
        self._resident[adapter.name] = adapter
        self.loads += 1
