"""Training checkpoints and exports leave the server as the cookbook and the `tinker` CLI fetch them.

- `tinker_cookbook.weights.download` of a `save_state` path (it exports the checkpoint with
  `save_weights_external(age_encryption_recipients=[a fresh key])`, downloads, decrypts and
  deletes the export), then `weights.build_hf_model`: the merged Hugging Face model's logprobs
  equal the server's.
- `tinker checkpoint download` of a training checkpoint and of an encrypted external export (its
  files keep their `.age` suffix and decrypt, with the recipient's identity, to the same adapter).
- Bad recipients are a 400 naming the field; nothing is saved and the model trains on.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyrage
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.harness import Stack
from tests.hf_reference import HFReference
from tests.numerics import assert_within
from tests.tinker_cli import run_tinker_cli

pytestmark = pytest.mark.slow

KEY = "tml-weights-download"
age: Any = pyrage
TOKENS = np.random.default_rng(21).integers(4, 2000, size=24).tolist()


class S:
    training: tinker.TrainingClient
    state_path: str


@pytest.fixture(scope="module", autouse=True)
def trained(stack: Stack) -> None:
    """One model trained a few steps, saved with save_state."""
    os.environ["TINKER_API_KEY"] = KEY
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=6).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(TOKENS[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(TOKENS) - 1, dtype=np.float32)),
        },
    )
    for _ in range(4):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    S.training, S.state_path = training, training.save_state("final").result().path


def checkpoint_paths() -> set[str]:
    listed = tinker.RestClient(api_key=KEY, base_url=os.environ["TINKER_BASE_URL"])
    return {c.tinker_path for c in listed.list_checkpoints(S.training.model_id).result().checkpoints}


@pytest.fixture(autouse=True)
def base_url(stack: Stack) -> None:
    os.environ["TINKER_BASE_URL"] = stack.base_url


def test_weights_download_of_a_save_state_path_builds_a_hf_model_with_the_servers_logprobs(
    stack: Stack, tmp_path: Path
) -> None:
    from tinker_cookbook import weights

    adapter = Path(weights.download(tinker_path=S.state_path, output_dir=str(tmp_path / "adapter")))
    assert {p.name for p in adapter.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert not any(p.name.endswith(".age") or p.name.startswith(".download-") for p in adapter.iterdir())
    assert not [p for p in checkpoint_paths() if "/external_weights/" in p]  # the export was deleted

    base = stack.data_dir / "models" / "tiny-qwen3"
    merged = tmp_path / "merged"
    weights.build_hf_model(
        base_model=str(base), adapter_path=str(adapter), output_path=str(merged), dtype="float32"
    )
    server = S.training.save_weights_and_get_sampling_client().result()
    server_lp = np.asarray(server.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:])
    reference, bound = HFReference(merged).logprobs(TOKENS[:-1], None)
    at = (torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:]))
    # the server's fp32 engine and the float64 reference of the merged model (whose fp32 merge
    # rounds each weight once more: one more unit of the bound)
    assert_within(server_lp, reference[at].numpy(), 2 * bound[at], "merged model logprobs")


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return run_tinker_cli(stack.base_url, KEY, *args)


def test_tinker_checkpoint_download_of_a_training_checkpoint_and_of_an_encrypted_export(
    stack: Stack, tmp_path: Path
) -> None:
    identity = age.x25519.Identity.generate()
    sealed = S.training.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]
    ).result().path

    def download(path: str) -> Path:
        done = cli(stack, "checkpoint", "download", path, "--output", str(tmp_path))
        assert done.returncode == 0, done.stderr
        return tmp_path / path.removeprefix("tinker://").replace("/", "_")

    plain = download(S.state_path)
    assert {p.name for p in plain.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    encrypted = download(sealed)
    names = {p.name for p in encrypted.iterdir()}
    assert {"adapter_model.safetensors.age", "adapter_config.json.age"} <= names
    assert all(name.endswith(".age") for name in names)
    for name in names:
        age.decrypt_file(str(encrypted / name), str(encrypted / name.removesuffix(".age")), [identity])
    ours, theirs = load_file(encrypted / "adapter_model.safetensors"), load_file(plain / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
    assert not [p for p in checkpoint_paths() if p.endswith("/external_weights/download")]


@pytest.mark.parametrize(
    ("recipients", "named"),
    [
        (["age1notakey"], "age_encryption_recipients[0]"),
        ([str(age.x25519.Identity.generate().to_public()), "ssh-ed25519 AAAA"], "age_encryption_recipients[1]"),
        ([], "age_encryption_recipients"),
        ([str(age.x25519.Identity.generate().to_public())] * 11, "at most 10"),
    ],
    ids=["bad-age-key", "bad-ssh-key", "empty", "too-many"],
)
def test_bad_recipients_are_a_400_naming_the_field_and_nothing_is_saved(
    recipients: list[str], named: str
) -> None:
    with pytest.raises(tinker.BadRequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
        S.training.save_weights_external("refused", age_encryption_recipients=recipients).result()
    assert not [p for p in checkpoint_paths() if p.endswith("/external_weights/refused")]
    assert S.training.save_weights_external("after-refused").result().path.endswith("/after-refused")
