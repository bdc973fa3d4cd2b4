"""The streamed safetensors writer produces files that safetensors itself reads back exactly."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from libs.checkpoints import layout
from libs.checkpoints.tensor_file import TensorFile


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.f32": torch.randn(3, 5, generator=g),
        "a.bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "c.i64": torch.arange(7),
        "d.bool": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5),
        "f.empty": torch.zeros(0, 4),
        "g.strided": torch.randn(6, 4, generator=g).t(),  # not contiguous: written as its values
    }


def test_safetensors_reads_back_every_tensor_bit_for_bit(tmp_path: Path) -> None:
    """Every dtype, a 0-dim, an empty and a non-contiguous tensor come back from safetensors'
    load_file with their dtype, shape and exact values, and the metadata from safe_open."""
    want = tensors()
    path, file = tmp_path / "x.safetensors", TensorFile(want, metadata={"format": "pt"})
    with open(path, "wb") as handle:
        file.write_to(handle)
    got = load_file(str(path))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert path.stat().st_size == len(file)


@pytest.mark.parametrize(
    "tensors",
    [
        {"x": torch.ones(1000), "y": torch.ones(1000), "z": torch.ones(10)},
        {"a": torch.ones(10), "big": torch.ones(100_000)},  # one tensor holds the middle byte
    ],
)
def test_the_fault_point_runs_once_at_the_middle_byte(tensors: dict[str, torch.Tensor]) -> None:
    """`midway` runs exactly once, when exactly half of the file's bytes are written, also when
    one tensor spans the middle; the file is complete afterwards."""
    file, out, seen = TensorFile(tensors), io.BytesIO(), []
    file.write_to(out, lambda: seen.append(out.tell()))
    assert seen == [len(file) // 2] and out.tell() == len(file)


def test_a_device_or_dtype_it_cannot_write_is_refused() -> None:
    """A dtype safetensors has no name for, and a tensor not on the host, are refused by name."""
    with pytest.raises(ValueError, match=r"c: a torch\.complex64 tensor"):
        TensorFile({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match=r"m: .* on meta cannot be written"):
        TensorFile({"m": torch.zeros(2, device="meta")})


def test_write_dir_atomically_streams_a_tensor_file(tmp_path: Path) -> None:
    """A TensorFile among a directory's files is written (and read back) like bytes are."""
    want = tensors()
    final = layout.write_dir_atomically(tmp_path / "v@1", {"w.safetensors": TensorFile(want), "m.json": b"{}"})
    got = load_file(str(final / "w.safetensors"))
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    assert (final / "m.json").read_bytes() == b"{}"
