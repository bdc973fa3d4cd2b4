"""A forward_backward that one work unit holds whole is answered by its trainer.

The trainer appends the result as soon as the unit's outcome is stored (services/trainer/answers.py),
so the answer does not wait for the planner. Here the planner is killed and kept down while the
trainer runs the request's unit (held there by a `hold` fault point): the SDK still gets its result,
and it is the one a second model of the same seed gets for the same datum with the planner running.
The planner, started again, folds the outcome it missed: the next optim_step and forward_backward
of the first model agree with the second's.
"""

from __future__ import annotations

from pathlib import Path

import tinker
from tinker import types

from libs.faults import fired, release
from tests.faults.holds import WAIT_S, wait_for
from tests.harness import Stack
from tests.sdk import fb_digest, tenant_datum

HOLD = "trainer.executing@2:hold"  # the first forward_backward's unit (the create's is the 1st)
ADAM = types.AdamParams(learning_rate=1e-2)


def test_a_forward_backward_is_answered_while_no_planner_runs_with_the_result_of_a_run_with_one(
    tmp_path: Path,
) -> None:
    faults = tmp_path / "faults"
    env = {"TINKERD_FAULT_POINTS": HOLD, "TINKERD_FAULT_DIR": str(faults)}
    stack = Stack(tmp_path / "stack", env_overrides=env).start()
    try:
        client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-trainer-answers")
        held = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=11).result()
        first = held.forward_backward([tenant_datum(0, 0, 0)], "cross_entropy")
        wait_for(lambda: fired(HOLD, faults), "the trainer running the forward_backward's unit")
        stack.stop_service("planner")
        release(HOLD, faults)
        answered = first.result(timeout=WAIT_S)  # no planner exists until this returns

        assert stack.start_service("planner").wait(WAIT_S), "the planner did not start again"
        reference = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=11).result()
        want = reference.forward_backward([tenant_datum(0, 0, 0)], "cross_entropy").result()
        assert fb_digest(answered) == fb_digest(want)

        for model in (held, reference):
            model.optim_step(ADAM).result()
        after = [m.forward_backward([tenant_datum(0, 1, 0)], "cross_entropy").result() for m in (held, reference)]
        assert fb_digest(after[0]) == fb_digest(after[1])
    finally:
        stack.stop()
