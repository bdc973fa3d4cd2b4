"""``KernelProbe``: one comparison per key, its verdict kept, its reason logged once."""

from __future__ import annotations

import logging

import pytest
import torch

from services.trainer.probes import KernelProbe


def test_each_key_is_compared_once_and_a_mismatch_is_logged_once_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The comparison runs at a key's first use only; a key it found wanting stays refused, and
    its one warning names the fast path, the key, the fallback and the reason."""
    calls: list[tuple[object, ...]] = []

    def compare(device: str, dtype: torch.dtype) -> str:
        calls.append((device, dtype))
        return "" if dtype == torch.float32 else "differs by 3 steps"

    probe = KernelProbe("the test kernel", "the eager path", compare)
    with caplog.at_level(logging.WARNING, logger="services.trainer.probes"):
        verdicts = [probe.usable("dev0", dtype) for dtype in (torch.float32, torch.bfloat16) * 3]
    assert verdicts == [True, False] * 3
    assert calls == [("dev0", torch.float32), ("dev0", torch.bfloat16)]
    assert [r.getMessage() for r in caplog.records] == [
        "the test kernel not used on dev0, torch.bfloat16, the eager path serves instead: differs by 3 steps"
    ]


def test_a_comparison_that_raises_refuses_the_key_and_names_the_error() -> None:
    """A fast path that fails to build or run is refused, its error named in the reason."""

    def compare(size: int) -> str:
        raise RuntimeError(f"no kernel for size {size}")

    probe = KernelProbe("the test kernel", "the eager path", compare)
    assert probe.mismatch(7) == "failed: RuntimeError: no kernel for size 7"
    assert not probe.usable(7)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_the_comparison_runs_with_autograd_inside_a_forward_only_call(context: type) -> None:
    """A first use inside a forward-only call still compares the backward: the comparison sees
    autograd on and tensors it makes can require gradients."""

    def compare() -> str:
        x = torch.ones(3, requires_grad=True)
        (2 * x).sum().backward()
        assert x.grad is not None
        return "" if torch.is_grad_enabled() and torch.equal(x.grad, torch.full((3,), 2.0)) else "no autograd"

    probe = KernelProbe("the test kernel", "the eager path", compare)
    with context():
        assert probe.usable()


def test_beyond_one_step_counts_values_past_one_rounding_step_and_misplaced_non_finites() -> None:
    """Against bf16 values near 1 (one step: 2**-7): a value one step off passes, one two steps
    off is counted, as is a NaN where the reference is finite; matching NaN and infinities pass,
    and the absolute slack widens the bound for values near 0."""
    from services.trainer.probes import beyond_one_step

    step = 2.0**-7
    ref = torch.tensor([1.0, 1.0, 1.0, float("nan"), float("inf"), 0.0, 0.0], dtype=torch.bfloat16)
    got = torch.tensor([1 + step, 1 + 2 * step, float("nan"), float("nan"), float("inf"), 1e-3, 0.0])
    assert beyond_one_step("x", got.to(torch.bfloat16), ref, 0.0) == (
        "x: 3 of 7 values beyond one rounding step of the eager path"
    )
    assert beyond_one_step("x", got.to(torch.bfloat16), ref, 2e-3) == (
        "x: 2 of 7 values beyond one rounding step of the eager path"
    )
