"""The fault-free reference: the seeded workload run once per session on a stack of its own.

Every fault scenario runs the same workload on another stack, with its fault, and must match
these results bit for bit. Both use `FAULT_ENV`: a duplicate window of 1.5 s, so nothing the
scenarios check can be hidden by JetStream dropping a duplicate (every restart and forced
redelivery comes after the window has passed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.checks import exactly_once
from tests.harness import Stack
from tests.sdk import REFERENCE_TENANTS, TenantRun, run_workload

DEDUPE_WINDOW_S = 1.5
FAULT_ENV = {
    "TINKERD_RETENTION_DEDUPE_WINDOW_S": str(DEDUPE_WINDOW_S),
    "TINKERD_TRAINER_SNAPSHOT_EVERY_STEPS": "2",  # restarts restore a snapshot, then replay
}


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, TenantRun]:
    """Each tenant's results and final checkpoint in a run with no fault, by tenant index
    (REFERENCE_TENANTS of them: a tenant's results depend on its index only)."""
    data_dir: Path = tmp_path_factory.mktemp("reference")
    stack = Stack(data_dir, env_overrides=FAULT_ENV).start()
    try:
        runs = run_workload(stack.base_url, stack.data_dir, tenants=REFERENCE_TENANTS, key="fault")
        errors = [(r.tenant, repr(r.error)) for r in runs if r.error is not None]
        assert not errors, f"the fault-free reference run failed: {errors}\n{stack.dump_logs()}"
        report = exactly_once(stack.nats_url)
        assert report.clean, f"the fault-free reference run applied something twice: {report}"
    finally:
        stack.stop()
    return {run.tenant: run for run in runs}
