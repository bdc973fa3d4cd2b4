"""Ephemeral sampler exports handed to a sampling engine from the trainer's memory, not the disk.

``save_weights_and_get_sampling_client()`` (the cookbook's RL path) saves an adapter that is
sampled at once and never named. Its files are still written (a restarted engine, or one on
another host, loads them), but the save does not wait for them: ``Handover`` copies the slot's
PEFT tensors into memory of the trainer's that another process on the same host can read, and
describes it as SGLang's ``/load_lora_adapter_from_tensors`` takes it (``AdapterHandover``). The
publisher answers the save with that description; the gateway hands it to the engine that
samples, which copies the tensors into its own adapter pool.

- On CUDA: one device buffer, described as SGLang reads tensors (torch's multiprocessing
  reductions, pickled: a CUDA IPC handle per tensor, no data). SGLang and Tinkerd's sampler
  (services/sampler/handover.py, with an unpickler that accepts torch's rebuild functions only)
  read the same description.
- On CPU: one safetensors segment in shared memory (``/dev/shm``, never fsynced), named by
  ``HANDOVER_SEGMENT_PREFIX``, described as ``{"tinkerd_segment": path}``; only Tinkerd's sampler reads
  it (SGLang has no CPU engine). Written by hand rather than through torch's CPU sharing, whose
  segments outlive every process once a reader has opened them.

A handover's memory is the save's own copy: later units may change the slot at once. The
``Shelf`` keeps it until its files are durable and then ``keep_s`` longer (an engine that has
not loaded it by then loads the files), and never more than ``limit`` handovers whose files are
durable. Nothing here outlives the process (a segment left by a killed trainer is removed when
a trainer starts: ``remove_orphan_segments``): an engine that asks for a released or dead trainer's handover gets an
error, and the gateway waits for the files instead.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
from safetensors.torch import load_file, save_file

from infra.net import host_id
from libs.contracts.publish import HANDOVER_SEGMENT_KEY, HANDOVER_SEGMENT_PREFIX, AdapterHandover

log = logging.getLogger("tinkerd.trainer")


def segment_dir() -> Path:
    """Where CPU handovers live: shared memory where the OS has it."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def remove_orphan_segments() -> int:
    """Remove the segments of trainer processes that are gone (killed before they released them);
    a segment's name carries its process id."""
    removed = 0
    for path in segment_dir().glob(f"{HANDOVER_SEGMENT_PREFIX}*"):
        pid = path.name.removeprefix(HANDOVER_SEGMENT_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def pack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of every tensor, each a view of one device buffer (one allocation, so one IPC
    handle serves the whole adapter; the views keep the buffer alive)."""
    dtypes = {t.dtype for t in tensors.values()}
    devices = {t.device for t in tensors.values()}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"a handover holds tensors of one dtype on one device, got {dtypes} on {devices}")
    (dtype,), (device,) = dtypes, devices
    buffer = torch.empty(sum(t.numel() for t in tensors.values()), dtype=dtype, device=device)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    with torch.no_grad():
        for name, tensor in tensors.items():
            view = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            views[name] = view
            offset += tensor.numel()
    return views


class Handover:
    """One ephemeral export's tensors, kept for engines to read (see the module docstring)."""

    def __init__(self, request_id: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.request_id = request_id
        self.segment: Path | None = None
        self.views: dict[str, torch.Tensor] = {}
        device = next(iter(tensors.values())).device.type if tensors else "cpu"
        if device == "cuda":
            self.views = pack(tensors)
            payload = bytes(ForkingPickler.dumps(self.views))
        else:
            self.segment = segment_dir() / f"{HANDOVER_SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.safetensors"
            # the host copy (these tensors may be the slot's own); the files are built from it
            save_file({name: t.detach().contiguous() for name, t in tensors.items()}, str(self.segment))
            payload = json.dumps({HANDOVER_SEGMENT_KEY: str(self.segment)}).encode()
        self.ref = AdapterHandover(
            config=config,
            tensors=base64.b64encode(payload).decode(),
            host=host_id(),
            device=device,
            nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        )

    def release(self) -> None:
        """Let the memory go: engines can no longer open it (those that did keep their copies)."""
        self.views = {}
        if self.segment is not None:
            with contextlib.suppress(FileNotFoundError):
                self.segment.unlink()

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors on the host, for the export's files (one device-to-host copy on CUDA)."""
        if self.segment is not None:
            return load_file(str(self.segment))
        return {name: view.cpu() for name, view in self.views.items()}


class Shelf:
    """The handovers this trainer keeps readable (see the module docstring)."""

    def __init__(self, keep_s: float, limit: int) -> None:
        self.keep_s = keep_s
        self.limit = max(0, limit)
        self._held: dict[str, Handover] = {}  # request id -> handover whose files are not durable
        self._durable: OrderedDict[str, tuple[Handover, float]] = OrderedDict()  # oldest first

    def hold(self, handover: Handover) -> None:
        self._held[handover.request_id] = handover

    def durable(self, request_id: str) -> None:
        """The export's files are durable: its buffer goes after ``keep_s``, or earlier when
        more than ``limit`` are kept."""
        handover = self._held.pop(request_id, None)
        if handover is None:
            return
        until = time.monotonic() + self.keep_s
        self._durable[request_id] = (handover, until)
        with contextlib.suppress(RuntimeError):  # no running loop (tests call it directly)
            asyncio.get_running_loop().call_later(self.keep_s, self._prune_at, until)
        self.prune()

    def _prune_at(self, until: float) -> None:
        """Prune once the clock has passed ``until``. The event loop may fire a timer early
        (uvloop's are whole milliseconds from a cached time): then wait out the rest, or the
        handover would stay until the next save's prune."""
        left = until - time.monotonic()
        if left > 0:
            asyncio.get_running_loop().call_later(left, self._prune_at, until)
            return
        self.prune()

    def prune(self) -> None:
        now = time.monotonic()
        for request_id, (_, until) in list(self._durable.items()):
            if until <= now or len(self._durable) > self.limit:
                handover, _ = self._durable.pop(request_id)
                handover.release()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees device blocks whose engines have let go of them
