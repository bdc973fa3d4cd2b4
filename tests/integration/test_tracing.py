"""One SDK call is one trace: gateway -> planner -> trainer -> publisher, through NATS headers."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from tests.harness import Stack


def test_save_for_sampler_is_one_trace_across_every_service(stack: Stack) -> None:
    client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-tracing")
    trainer = client.create_lora_training_client(base_model="tiny-qwen3", rank=4)
    tokens = [5, 6, 7, 8, 9]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)), "weights": types.TensorData.from_numpy(np.ones(4, dtype=np.float32))},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    saved = trainer.save_weights_for_sampler("traced").result()
    assert saved.path.endswith("/sampler_weights/traced")

    spans = stack.spans()
    publish = [sp for sp in spans if sp["name"] == "publisher.publish"]
    assert publish, "the publisher exported no span"
    trace_id = publish[-1]["trace_id"]
    in_trace = {(sp["service"], sp["name"]) for sp in spans if sp["trace_id"] == trace_id}
    assert ("gateway", "POST /api/v1/save_weights_for_sampler") in in_trace
    assert ("planner", "planner.unit") in in_trace
    assert ("trainer", "trainer.execute") in in_trace
    assert ("publisher", "publisher.publish") in in_trace
