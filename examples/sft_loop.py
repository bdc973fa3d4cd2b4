"""Supervised fine-tuning against a running Tinkerd (`make run`), with the public Tinker SDK only.

    python examples/sft_loop.py [--base-url http://127.0.0.1:8000] [--steps 40]

Teaches a LoRA adapter one sentence, then samples from it.
"""

import argparse

import numpy as np
import tinker
from tinker import types

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--text", default="Tinkerd says: the quick brown fox trains a LoRA adapter.")
args = parser.parse_args()

service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-example-sft")
training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
tokenizer = training.get_tokenizer()
tokens = tokenizer.encode(args.text)
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])), "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32))},
)

for step in range(args.steps):
    forward_backward = training.forward_backward([datum], "cross_entropy")
    optim = training.optim_step(types.AdamParams(learning_rate=5e-3))
    loss = forward_backward.result().metrics["loss:sum"] / (len(tokens) - 1)
    optim.result()
    if step % 5 == 0 or step == args.steps - 1:
        print(f"step {step:3d}  loss per token {loss:.4f}")

sampler = training.save_weights_and_get_sampling_client().result()
prompt = types.ModelInput.from_ints(tokens[:4])
params = types.SamplingParams(max_tokens=len(tokens), temperature=0.0)
sample = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
print("prompt :", tokenizer.decode(tokens[:4]))
print("sample :", tokenizer.decode(sample.sequences[0].tokens))
print("state  :", training.save_state("sft-final").result().path)
