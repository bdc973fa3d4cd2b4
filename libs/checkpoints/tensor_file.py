"""A safetensors file written from each tensor's own memory, without building it in RAM first.

``safetensors.torch.save`` returns the whole file as one ``bytes`` (every tensor copied into it),
which the checkpoint writer then writes out: for a rank-32 Qwen3-8B adapter (369 MB) building
those bytes took about 500 ms on the H200 host, as long as the write and fsync
(bench/results/gpu_stack/run6/stack_logs.txt). This writes the same format (an 8-byte
little-endian header length, a JSON header padded with spaces to 8 bytes, then each tensor's raw
little-endian bytes at its ``data_offsets``) straight from the tensors' buffers into the file.
Reading is safetensors' own ``load_file``/``safe_open`` (tests check the round trip).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Mapping
from typing import BinaryIO

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class TensorFile:
    """Host tensors to be written as one safetensors file (``layout.write_dir_atomically``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
        assert sys.byteorder == "little", "safetensors stores little-endian data"
        self.tensors = {name: tensors[name].detach().contiguous() for name in sorted(tensors)}
        for name, tensor in self.tensors.items():
            if tensor.device.type != "cpu" or tensor.dtype not in _DTYPES:
                raise ValueError(f"{name}: a {tensor.dtype} tensor on {tensor.device} cannot be written")
        self.header = self._header(dict(metadata or {}))

    def _header(self, metadata: dict[str, str]) -> bytes:
        entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, tensor in self.tensors.items():
            size = tensor.numel() * tensor.element_size()
            entries[name] = {
                "dtype": _DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        header = json.dumps(entries, separators=(",", ":")).encode()
        return header + b" " * (-len(header) % 8)

    def __len__(self) -> int:
        """The file's size in bytes."""
        return 8 + len(self.header) + sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write_to(self, handle: BinaryIO, midway: Callable[[], None] = lambda: None) -> None:
        """Write the file; ``midway`` runs once, when exactly half of its bytes are written (the
        fault point: a crash or a full disk there leaves half a file)."""
        handle.write(struct.pack("<Q", len(self.header)))
        handle.write(self.header)
        half, written, called = len(self) // 2, 8 + len(self.header), False
        for tensor in self.tensors.values():
            data = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")
            if not called and written + len(data) >= half:  # the tensor that crosses the middle
                cut = max(0, half - written)
                handle.write(data[:cut])
                midway()
                called = True
                data = data[cut:]
                written += cut
            handle.write(data)  # the tensor's own memory
            written += len(data)
        if not called:
            midway()
