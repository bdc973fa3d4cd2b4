"""Run under tinker==0.24.1 (the JSON-era SDK): one training and sampling session against a stack.

Usage: python sdk024_client.py BASE_URL API_KEY. Prints one JSON object of what it observed; any
failure raises (non-zero exit) with the SDK's own error.
"""

from __future__ import annotations

import json
import sys

import tinker
from tinker import types


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
            "weights": types.TensorData(
                data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]
            ),
        },
    )


def main(base_url: str, api_key: str) -> dict[str, object]:
    data = [datum([5, 6, 7, 8, 9]), datum([11, 12, 13, 14])]
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4)
    fwdbwd = training.forward_backward(data, "cross_entropy").result()
    forward = training.forward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state = training.save_state("state024").result().path
    sampler_path = training.save_weights_for_sampler("sampler024").result().path
    sampler = service.create_sampling_client(model_path=sampler_path)
    sample = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    logprobs = sampler.compute_logprobs(prompt).result() if hasattr(sampler, "compute_logprobs") else None
    training.load_state(state).result()
    resumed = service.create_training_client_from_state(state)
    resumed_fwdbwd = resumed.forward_backward(data, "cross_entropy").result()
    listed = service.create_rest_client().list_checkpoints(training.model_id).result()
    return {
        "fwdbwd_metrics": fwdbwd.metrics,
        "fwdbwd_outputs": len(fwdbwd.loss_fn_outputs),
        "forward_logprobs": len(forward.loss_fn_outputs[0]["logprobs"].data),
        "state": state,
        "sampler_path": sampler_path,
        "samples": [list(seq.tokens) for seq in sample.sequences],
        "sample_logprobs": [seq.logprobs is not None for seq in sample.sequences],
        "compute_logprobs": logprobs,
        "resumed_metrics": resumed_fwdbwd.metrics,
        "checkpoints": sorted(c.checkpoint_id for c in listed.checkpoints),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
