"""The chaos soak's quick mode: about a minute of random kill -9s (nats-server included) while
4 tenants train and sample; every call completes once and matches the fault-free reference.

The full 10-minute soak is `python -m bench.chaos_soak` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos_soak import TENANTS, soak, summary
from tests.sdk import TenantRun


def test_chaos_soak_quick(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """Lost, doubled and stalled requests are all 0, every killed process came back, and every
    round's results are bit-identical to the reference."""
    report = soak(tmp_path, minutes=1.0, reference=reference, tenants=TENANTS, seed=14, quick=True)
    text = summary(report)
    assert len(report.kills) >= 3, text
    assert report.ok, text


pytestmark = pytest.mark.slow
