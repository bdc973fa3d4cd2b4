"""A tiny REINFORCE loop (importance_sampling loss) against a running Tinkerd, public SDK only.

    python examples/rl_loop.py [--base-url http://127.0.0.1:8000] [--iterations 8]

Reward: the fraction of sampled tokens with an even id (about 0.5 at first). It should rise.
"""

import argparse

import numpy as np
import tinker
from tinker import types

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000")
parser.add_argument("--iterations", type=int, default=8)
parser.add_argument("--group", type=int, default=8)
args = parser.parse_args()

service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-example-rl")
training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
prompt = [5, 6, 7, 8]
params = types.SamplingParams(max_tokens=6, temperature=1.0)

for iteration in range(args.iterations):
    sampler = training.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=args.group, sampling_params=params).result()
    rewards = np.array([np.mean([t % 2 == 0 for t in s.tokens]) for s in result.sequences], dtype=np.float32)
    advantages = rewards - rewards.mean()
    data = []
    for seq, advantage in zip(result.sequences, advantages, strict=True):
        tokens = prompt + list(seq.tokens)
        n = len(tokens) - 1
        sampled = len(seq.tokens)
        inputs = {
            "target_tokens": np.array(tokens[1:]),
            "logprobs": np.array([0.0] * (n - sampled) + list(seq.logprobs or []), dtype=np.float32),
            "advantages": np.array([0.0] * (n - sampled) + [advantage] * sampled, dtype=np.float32),
        }
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
        ))
    training.forward_backward(data, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    print(f"iteration {iteration}  mean reward {rewards.mean():.3f}")
