"""Tensors sent to ``/load_lora_adapter_from_tensors``, read as SGLang reads them, but safely.

SGLang's route takes ``serialized_named_tensors``: per tensor-parallel rank, a base64 string of
a ``{name: tensor}`` dict pickled with torch's multiprocessing reductions. Those reductions
carry handles, not data: a CUDA tensor is a CUDA IPC handle into the sender's device memory. So
the tensors can only be read on the sender's host, while the sender keeps them (Tinkerd's
trainer: services/trainer/handover.py).

Unpickling runs code named in the payload, so ``decode`` accepts only the globals those
reductions use (torch's rebuild functions, storage and tensor classes, dtypes and sizes) and
refuses anything else before it is called; a CPU tensor shared through a file descriptor (which
needs a connection to the sender) fails to open.

A CPU trainer hands over a safetensors segment in shared memory instead, as
``{"tinkerd_segment": path}`` (base64 JSON, the trainer's own format: SGLang has no CPU
engine); only a file named like the trainer's segments is read.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.multiprocessing  # registers the reductions the payload names
from safetensors.torch import load_file

from libs.contracts.publish import HANDOVER_SEGMENT_KEY, HANDOVER_SEGMENT_PREFIX

_REBUILDERS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename"}
_STORAGES = {"UntypedStorage", "TypedStorage"}


class HandoverError(ValueError):
    """The payload is not tensors this engine can read (the message says why)."""


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch.multiprocessing.reductions" and name in _REBUILDERS)
            or (module == "torch.storage" and name in _STORAGES)
            or (module == "torch" and (name in {"Tensor", "Size"} or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise HandoverError(f"serialized tensors may only use torch's tensor reductions, not {module}.{name}")
        return super().find_class(module, name)


def decode(payload: str) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` of one rank's entry of ``serialized_named_tensors``.

    Raises:
        HandoverError: not base64, not a pickled ``{name: tensor}``, a global outside the allowed
            set, or tensors that cannot be opened here (another host, or memory the sender has
            let go of).
    """
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HandoverError(f"serialized_named_tensors must be base64 strings: {exc}") from exc
    if data.startswith(b"{"):
        return _segment(data)
    try:
        tensors = _TensorsOnly(io.BytesIO(data)).load()
    except HandoverError:
        raise
    except Exception as exc:  # a segment or IPC handle that no longer exists, another host, garbage
        reason = f"{type(exc).__name__}: {exc}"
        raise HandoverError(f"the serialized tensors cannot be opened here: {reason}") from exc
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise HandoverError("serialized_named_tensors must each hold a {name: tensor} dict")
    return tensors


def _segment(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a CPU trainer's shared-memory segment (see the module docstring)."""
    try:
        path = Path(msgspec.json.decode(data, type=dict[str, str])[HANDOVER_SEGMENT_KEY])
    except (msgspec.DecodeError, KeyError) as exc:
        raise HandoverError(f"serialized_named_tensors holds neither pickled tensors nor a segment: {exc}") from exc
    if not (path.name.startswith(HANDOVER_SEGMENT_PREFIX) and path.suffix == ".safetensors"):
        raise HandoverError(f"{path} is not a handover segment ({HANDOVER_SEGMENT_PREFIX}*.safetensors)")
    try:
        return load_file(str(path))
    except Exception as exc:  # gone (released, or another host), or not safetensors
        reason = f"{type(exc).__name__}: {exc}"
        raise HandoverError(f"the serialized tensors cannot be opened here: {reason}") from exc
