"""Trainer settings."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from infra.config import DEFAULT_DATA_DIR, DEFAULT_NATS_URL, MAX_LORA_RANK, NUM_SLOTS, from_env


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = DEFAULT_NATS_URL
    data_dir: str = DEFAULT_DATA_DIR
    base_model: str = "tiny-qwen3"
    group: str = "default"
    """Trainer group: the planner's work subject; all ranks of one TP group share it."""
    trainer_id: str = ""
    """Defaults to `<group>-<hostname>-<pid>`."""
    num_slots: int = NUM_SLOTS.default
    max_lora_rank: int = MAX_LORA_RANK.default
    tp: int = 1
    """Tensor-parallel size: > 1 makes `tinkerd serve trainer` start that many ranks of one group
    (services/trainer/group.py). Ignored by a process started with `RANK`/`WORLD_SIZE` set."""
    device: str = "auto"
    """cpu | cuda | auto (cuda when available)."""
    attention_backend: str = "auto"
    """A key of services/trainer/attention.py's ATTENTION_BACKENDS; auto: varlen_flash_cudnn on
    CUDA, sdpa_per_document on CPU (engine.resolve_backend).
    ``varlen_flash_cudnn`` runs a one-document step of at least 2,048 tokens through cuDNN's
    attention (docs/gpu.md, "Attention backends")."""
    fused_cross_entropy: bool | None = None
    """The chunked fused linear cross-entropy (fused_ce.py): on, off, or unset: on CUDA for a
    forward whose unfused logits would pass engine.UNFUSED_LOGITS_BYTES, off on CPU."""
    step_graphs: bool | None = None
    """``forward_backward`` calls of at most ``step_graph_max_tokens`` (padded) tokens, whose models
    train the same modules, run at static shapes, replayed as CUDA graphs on CUDA
    (services/trainer/step_graphs.py; TP=1): on, off, or unset: on CUDA, off on CPU."""
    step_graph_max_tokens: int | None = None
    """The largest step recorded; unset: 4,096 tokens on a card of at least 120 GiB, 2,048 on a
    smaller one (engine.step_graph_tokens_for). The recordings keep the largest one's activations
    reserved beside any longer step, which runs eagerly. At the 8B shape a replay gains 2.1x at
    1,024 tokens and 1.4x at 2,048 on the H200, and 2-3 % at 4,096 on an H100 (docs/benchmarks.md)."""
    heartbeat_s: float = 5.0
    snapshot_every_steps: int = 20
    """Take an internal snapshot after this many optimizer steps (all slots together)..."""
    snapshot_every_s: float = 120.0
    """...or after this many seconds with work done, whichever comes first. Replay stays short."""
    host_page_budget_bytes: int = 8 << 30
    """Paged-out models' state kept in host memory; beyond it the oldest go to disk (a cache:
    recovery never needs it, see paging.py)."""
    save_writers: int = 4
    """Saves whose files are written at once, behind the unit path (each holds a host copy of its
    slot until its files are fsynced); a unit that would start one more waits for the oldest."""
    handover: bool = True
    """Ephemeral sampler exports (``save_weights_and_get_sampling_client()``) are answered as soon
    as the slot is copied, and the engine loads them from the trainer's memory
    (services/trainer/handover.py); their files follow. Off: answered once the files are fsynced."""
    handover_keep_s: float = 60.0
    """How long a handed-over adapter stays readable after its files are durable."""
    handover_limit: int = 4
    """At most this many handed-over adapters whose files are durable are kept (device memory on
    CUDA: 369 MB each for a rank-32 Qwen3-8B adapter)."""
    unit_timeout_s: float = 900.0
    """A unit still running after this long means a wedged trainer (a hung kernel, a deadlock):
    the trainer exits, is restarted by its supervisor, and the unit is delivered again."""


def load_config(env: Mapping[str, str], **overrides: object) -> TrainerConfig:
    return from_env(TrainerConfig, "trainer", env, **overrides)
