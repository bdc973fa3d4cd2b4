"""A sample whose result the broker could not take is run again once the broker is back.

The engine has generated the sample (held right there by a `hold` fault point in the sampler)
when nats-server is frozen (SIGSTOP: alive, answering nothing). Once the engine's answer is let
go, the gateway cannot append the sample's result (the client times out after 10 s). Only when
the gateway logs that it will run the job again is nats-server resumed (SIGCONT). The SDK's
sample then completes with the tokens a sample of the same weights gave before the fault
(greedy), not with an error.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import tinker
from tinker import types

from libs.faults import fired, release
from tests.faults.holds import WAIT_S, train, wait_for
from tests.harness import Stack

HOLD = "sampler.generated@2:hold"  # the second sample: the first is the reference
PROMPT = [5, 6, 7]
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)
RETRY_LINE = "the broker did not answer"


def test_a_sample_whose_result_the_frozen_broker_could_not_take_runs_again_once_it_is_back(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    env = {"TINKERD_FAULT_POINTS": HOLD, "TINKERD_FAULT_DIR": str(faults)}
    stack = Stack(tmp_path / "stack", env_overrides=env)
    resumed = threading.Event()

    def resume_on_retry(service: str, line: str) -> None:
        if service.startswith("gateway") and RETRY_LINE in line and not resumed.is_set():
            nats = stack.nats
            assert nats is not None
            os.kill(nats.process.pid, signal.SIGCONT)
            resumed.set()

    stack.listeners.append(resume_on_retry)
    stack.start()
    try:
        client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-broker-paused")
        trainer = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
        train(trainer, 0, 0)
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(PROMPT)
        want = list(sampler.sample(prompt, num_samples=1, sampling_params=GREEDY).result().sequences[0].tokens)

        held = sampler.sample(prompt, num_samples=1, sampling_params=GREEDY)
        wait_for(lambda: fired(HOLD, faults), "the hold of the second sample in the engine")
        nats = stack.nats
        assert nats is not None
        os.kill(nats.process.pid, signal.SIGSTOP)
        try:
            release(HOLD, faults)
            assert resumed.wait(WAIT_S), f"the gateway never ran the job again\n{stack.dump_logs()}"
        finally:
            os.kill(nats.process.pid, signal.SIGCONT)  # never leave it frozen (a no-op once resumed)
        got = list(held.result().sequences[0].tokens)
    finally:
        stack.stop()
    assert got == want
