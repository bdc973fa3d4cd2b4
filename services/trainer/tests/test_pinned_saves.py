"""A save's copy of its slot on CUDA: one pinned host buffer per save, reused by the next one,
and allocated ahead of the save on a background thread."""

from __future__ import annotations

import threading

import pytest
import torch

from libs.contracts.common import LoraConfig
from services.trainer.slot_state import PinnedPool, SlotState, to_pinned

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def device_state(seed: int) -> SlotState:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    adapter = {"a.lora_A": rand(3, 8, 5), "a.lora_B": rand(7, 8), "out.lora_A": rand(8, 33)}
    exp_avg = {k: rand(*v.shape) for k, v in adapter.items()}
    exp_avg_sq = {k: rand(*v.shape).abs() for k, v in adapter.items()}
    return SlotState(LoraConfig(rank=8), 3, adapter, exp_avg, exp_avg_sq)


@needs_cuda
def test_cuda_pinned_copy_equals_the_slot_state_bit_for_bit_and_its_buffer_serves_the_next_save() -> None:
    pool = PinnedPool(keep=1)
    state = device_state(1)
    copied, buffer = to_pinned(state, pool)
    assert buffer.is_pinned()
    for table, original in (
        (copied.adapter, state.adapter),
        (copied.exp_avg, state.exp_avg),
        (copied.exp_avg_sq, state.exp_avg_sq),
    ):
        assert table.keys() == original.keys()
        for name, tensor in table.items():
            assert tensor.device.type == "cpu" and tensor.is_contiguous()
            assert torch.equal(tensor, original[name].cpu()), name
    assert (copied.config, copied.step) == (state.config, state.step)

    pool.give(buffer)
    later = device_state(2)
    second, again = to_pinned(later, pool)
    assert again.data_ptr() == buffer.data_ptr(), "the kept buffer was not reused"
    for name, tensor in second.exp_avg_sq.items():
        assert torch.equal(tensor, later.exp_avg_sq[name].cpu()), name


def test_pool_hands_out_the_smallest_kept_buffer_that_fits_among_buffers_of_different_sizes() -> None:
    pool = PinnedPool(keep=2)
    small, large = torch.empty(100, dtype=torch.uint8), torch.empty(300, dtype=torch.uint8)
    pool.give(large)
    pool.give(small)
    assert pool.take(50) is small
    assert pool.take(200) is large


def test_prepared_buffers_serve_the_next_saves_and_a_save_waits_for_one_being_prepared() -> None:
    """``prepare`` allocates on its own thread (here held until released): a ``take`` meanwhile
    gets one of the prepared buffers instead of allocating a third, a second ``prepare`` of the
    same need allocates nothing more, and a need larger than every prepared buffer gets its own."""
    release, made = threading.Event(), []

    def allocate(nbytes: int) -> torch.Tensor:
        release.wait()
        made.append(torch.empty(nbytes, dtype=torch.uint8))
        return made[-1]

    pool = PinnedPool(keep=4, allocate=allocate)
    pool.prepare(1000, count=2)
    pool.prepare(800, count=2)  # already coming: nothing more
    taken: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take(900)))
    taker.start()
    release.set()
    taker.join()
    pool.ready()  # the second preparation may still be running when the first buffer is taken
    assert len(made) == 2 and any(taken[0] is b for b in made)
    assert pool.take(1000) is not taken[0] and len(made) == 2  # the other prepared one
    assert pool.take(5000).numel() == 5000 and len(made) == 3
