"""Contract: the official `tinker` SDK calls every public method of its four clients against the
real stack, on the tiny model.

The surface is found by introspection (`surface.public_methods`): every public callable of
ServiceClient, TrainingClient, SamplingClient and RestClient, `_async` variants included. Each call
is recorded as it happens; the last test fails for any method that was neither called nor listed in
UNSUPPORTED with a reason, so a newer SDK's new method fails the suite until it is handled.

The tests run in file order and share the clients they create (module-scoped state).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import tinker
import torch
from tinker import types
from tinker.lib.api_future_impl import QueueState

from tests.contract.surface import Recorder
from tests.harness import Stack

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

KEY = "tml-contract"
OTHER_KEY = "tml-contract-other"

UNSUPPORTED: dict[str, str] = {
    "ServiceClient.copy_weights": "copy_weights is not offered (501): load the checkpoint and save it",
    "RestClient.copy_weights": "copy_weights is not offered (501)",
    "RestClient.copy_weights_async": "copy_weights is not offered (501)",
    "RestClient.export_session_trace": "trace export is not offered (501): traces go to OpenTelemetry",
    "RestClient.export_session_trace_async": "trace export is not offered (501)",
    "RestClient.get_audit_log": "no audit log (501): operation events are on the bus (`tinkerd events`)",
    "RestClient.get_audit_log_async": "no audit log (501)",
    "RestClient.get_billing_usage": "no billing on a self-hosted server (501)",
    "RestClient.get_billing_usage_async": "no billing on a self-hosted server (501)",
    "RestClient.get_current_checkpoint_storage_usage": "no billing on a self-hosted server (501)",
    "RestClient.get_current_checkpoint_storage_usage_async": "no billing on a self-hosted server (501)",
    "RestClient.search_sessions": "session search is not offered (501): list_sessions/get_session instead",
    "RestClient.whoami": "JWT auth is off (pjwt_auth_enabled=false); whoami only decodes a JWT, client-side",
}
"""Methods not exercised, with the reason. The SDK retries a 5xx for up to 5 minutes inside
`execute_with_retries`, so the 501 endpoints behind these are checked with raw HTTP below."""

recorder = Recorder([tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient])
S = SimpleNamespace()


@pytest.fixture(scope="module", autouse=True)
def recording() -> Iterator[Recorder]:
    with recorder.install():
        yield recorder


def ints(values: list[int]) -> types.TensorData:
    return types.TensorData(data=values, dtype="int64", shape=[len(values)])


def floats(values: list[float]) -> types.TensorData:
    return types.TensorData(data=values, dtype="float32", shape=[len(values)])


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": ints(tokens[1:]), "weights": floats([1.0] * (len(tokens) - 1))},
    )


DATA = [datum([5, 6, 7, 8, 9]), datum([11, 12, 13, 14])]
PROMPT = types.ModelInput.from_ints([5, 6, 7])
PARAMS = types.SamplingParams(max_tokens=3, temperature=1.0, seed=3)


async def settle(value: Any) -> Any:
    """Await until a plain value comes out: 0.38's `_async` training methods return a future."""
    while inspect.isawaitable(value):
        value = await value
    return value


def rest(stack: Stack, key: str = KEY) -> tinker.RestClient:
    return tinker.RestClient(base_url=stack.base_url, api_key=key)


def tokenizer_dir(stack: Stack) -> str:
    return str(stack.data_dir / "models" / "tiny-qwen3")


def test_service_client_bootstrap(stack: Stack) -> None:
    S.service = tinker.ServiceClient(
        base_url=stack.base_url, api_key=KEY, user_metadata={"suite": "contract"}
    )
    caps = S.service.get_server_capabilities()
    assert caps.supported_models[0].model_name == "tiny-qwen3"
    assert isinstance(S.service.get_console_url(), str)
    S.service.get_telemetry()
    assert S.service.create_rest_client().get_server_capabilities().result() == caps


def test_training_client(stack: Stack) -> None:
    tc = S.service.create_lora_training_client(
        base_model="tiny-qwen3", rank=4, seed=0, user_metadata={"renderer_name": "role_colon"}
    ).result()
    S.training = tc
    info = tc.get_info()
    assert info.model_data.model_name == "tiny-qwen3" and info.lora_rank == 4
    assert tc.get_tokenizer().encode("hello")
    assert isinstance(tc.get_console_url(), str)
    tc.get_telemetry()
    out = tc.forward_backward(DATA, "cross_entropy").result()
    assert "loss:sum" in out.metrics and len(out.loss_fn_outputs) == 2
    assert all(key.count(":") == 1 for key in out.metrics)
    forward = tc.forward(DATA, "cross_entropy").result()
    assert len(forward.loss_fn_outputs[0]["logprobs"].data) == 4
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_custom_losses_run_client_side(stack: Stack) -> None:
    def neg_ll(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -torch.stack([lp.sum() for lp in logprobs]).sum()
        return loss, {"neg_ll:sum": float(loss)}

    def per_datum(
        logprobs: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    assert "loss:sum" in S.training.forward_backward_custom(DATA, neg_ll).result().metrics
    handle = S.service.create_custom_loss(per_datum, input_ranks={"logprobs": 1, "weights": 1}).result()
    assert "loss:sum" in S.training.forward_backward_custom(DATA, handle).result().metrics
    S.training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_saves(stack: Stack) -> None:
    tc = S.training
    S.state_path = tc.save_state("state1", user_metadata={"step": "2"}).result().path
    S.sampler_path = tc.save_weights_for_sampler("sampler1").result().path
    S.external_path = tc.save_weights_external("export1", ttl_seconds=7200).result().path
    assert S.state_path.endswith("/weights/state1")
    assert S.sampler_path.endswith("/sampler_weights/sampler1")
    assert S.external_path.endswith("/external_weights/export1")


async def test_training_client_async_variants(stack: Stack) -> None:
    tc = S.training
    assert (await tc.get_info_async()).model_id == tc.model_id
    assert (await settle(tc.forward_backward_async(DATA, "cross_entropy"))).metrics
    assert (await settle(tc.forward_async(DATA, "cross_entropy"))).loss_fn_outputs
    await settle(tc.forward_backward_custom_async(DATA, lambda d, lps: (-sum(lp.sum() for lp in lps), {})))
    await settle(tc.optim_step_async(types.AdamParams(learning_rate=1e-3)))
    assert (await settle(tc.save_state_async("state2"))).path.endswith("/weights/state2")
    assert (await settle(tc.save_weights_for_sampler_async("sampler2"))).path
    assert (await settle(tc.save_weights_external_async("export2"))).path
    await settle(tc.load_state_async(S.state_path))
    await settle(tc.load_state_with_optimizer_async(S.state_path))
    sampler = await settle(tc.save_weights_and_get_sampling_client_async())
    assert len((await settle(sampler.sample_async(PROMPT, 1, PARAMS))).sequences) == 1
    sampler = await settle(tc.create_sampling_client_async(S.sampler_path))
    assert await sampler.get_base_model_async()


def test_legacy_load_state(stack: Stack) -> None:
    S.training.load_state(S.state_path).result()
    S.training.load_state_with_optimizer(S.state_path).result()


def test_sampling_client(stack: Stack) -> None:
    sampler = S.training.create_sampling_client(S.sampler_path).result()
    response = sampler.sample(PROMPT, num_samples=2, sampling_params=PARAMS).result()
    assert len(response.sequences) == 2 and all(seq.logprobs for seq in response.sequences)
    logprobs = sampler.compute_logprobs(PROMPT).result()
    assert len(logprobs) == 3 and logprobs[0] is None
    assert sampler.get_base_model() == "tiny-qwen3"
    sampler.get_telemetry()
    sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "a test")
    clone = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=KEY)
    assert len(clone.sample(PROMPT, 1, PARAMS).result().sequences) == 1
    ephemeral = S.training.save_weights_and_get_sampling_client().result()
    assert ephemeral.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens


def test_sampling_client_on_the_base_model(stack: Stack) -> None:
    base = S.service.create_sampling_client(base_model=tokenizer_dir(stack)).result()
    assert base.get_tokenizer().encode("hello")
    direct = tinker.SamplingClient.create(S.service.holder, model_path=S.sampler_path).result()
    assert direct.sample(PROMPT, 1, PARAMS).result().sequences


async def test_sampling_async_variants(stack: Stack) -> None:
    sampler = await S.service.create_sampling_client_async(model_path=S.sampler_path)
    assert len((await sampler.sample_async(PROMPT, 1, PARAMS)).sequences) == 1
    assert len(await sampler.compute_logprobs_async(PROMPT)) == 3
    assert (await S.service.get_server_capabilities_async()).supported_models


def test_create_training_clients_from_state(stack: Stack) -> None:
    resumed = S.service.create_training_client_from_state(S.state_path).result()
    assert resumed.get_info().lora_rank == 4
    resumed.forward_backward(DATA, "cross_entropy").result()
    with_optimizer = S.service.create_training_client_from_state_with_optimizer(S.state_path).result()
    with_optimizer.forward_backward(DATA, "cross_entropy").result()
    with_optimizer.optim_step(types.AdamParams(learning_rate=1e-3)).result()


async def test_service_client_async_variants(stack: Stack) -> None:
    created = await S.service.create_lora_training_client_async(base_model="tiny-qwen3", rank=2)
    assert (await created.get_info_async()).lora_rank == 2
    resumed = await S.service.create_training_client_from_state_async(S.state_path)
    resumed_opt = await S.service.create_training_client_from_state_with_optimizer_async(S.state_path)
    assert {resumed.get_info().lora_rank, resumed_opt.get_info().lora_rank} == {4}


def test_rest_client_runs_and_checkpoints(stack: Stack) -> None:
    rc = rest(stack)
    run_id = S.training.model_id
    runs = rc.list_training_runs(limit=50).result()
    assert run_id in {r.training_run_id for r in runs.training_runs}
    run = rc.get_training_run(run_id).result()
    assert run.user_metadata == {"renderer_name": "role_colon"} and run.lora_rank == 4
    assert run.last_checkpoint is not None and run.last_sampler_checkpoint is not None
    assert rc.get_training_run_by_tinker_path(S.state_path).result().training_run_id == run_id
    ids = {c.checkpoint_id for c in rc.list_checkpoints(run_id).result().checkpoints}
    assert {"weights/state1", "sampler_weights/sampler1", "external_weights/export1"} <= ids
    mine = rc.list_user_checkpoints().result()
    assert S.state_path in {c.tinker_path for c in mine.checkpoints}
    info = rc.get_weights_info_by_tinker_path(S.state_path).result()
    assert info.is_lora and info.lora_rank == 4 and info.base_model == "tiny-qwen3"
    urls = rc.get_external_weights_urls(S.external_path).result()
    assert "adapter_model.safetensors" in urls.urls
    assert httpx.get(urls.urls["adapter_config.json"]).json()["r"] == 4


def test_rest_client_publish_ttl_delete(stack: Stack) -> None:
    rc, other = rest(stack), rest(stack, OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(S.sampler_path).result()
    rc.publish_checkpoint_from_tinker_path(S.sampler_path).result()
    assert other.get_weights_info_by_tinker_path(S.sampler_path).result().lora_rank == 4
    rc.unpublish_checkpoint_from_tinker_path(S.sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(S.sampler_path).result()
    rc.set_checkpoint_ttl_from_tinker_path(S.sampler_path, 3600).result()
    expiring = [
        c
        for c in rc.list_checkpoints(S.training.model_id).result().checkpoints
        if c.tinker_path == S.sampler_path
    ]
    assert expiring[0].expires_at is not None
    rc.set_checkpoint_ttl_from_tinker_path(S.sampler_path, None).result()
    doomed = S.training.save_state("doomed").result().path
    rc.delete_checkpoint_from_tinker_path(doomed).result()
    rc.delete_checkpoint_from_tinker_path(doomed).result()  # idempotent
    doomed2 = S.training.save_state("doomed2").result().path
    rc.delete_checkpoint(S.training.model_id, "weights/doomed2").result()
    left = {c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints}
    assert doomed not in left and doomed2 not in left


def test_rest_client_sessions_and_samplers(stack: Stack) -> None:
    rc = rest(stack)
    session_id = S.service.holder.get_session_id()
    assert session_id in rc.list_sessions(limit=100).result().sessions
    session = rc.get_session(session_id).result()
    assert S.training.model_id in session.training_run_ids and session.sampler_ids
    sampler = rc.get_sampler(session.sampler_ids[0]).result()
    assert sampler.base_model == "tiny-qwen3"
    rc.assign_session_project(session_id, "proj-1").result()
    rc.get_telemetry()


async def test_rest_client_async_variants(stack: Stack) -> None:
    rc, run_id = rest(stack), S.training.model_id
    session_id = S.service.holder.get_session_id()
    assert (await rc.list_training_runs_async()).training_runs
    assert (await rc.get_training_run_async(run_id)).training_run_id == run_id
    assert (await rc.get_training_run_by_tinker_path_async(S.state_path)).training_run_id == run_id
    assert (await rc.list_checkpoints_async(run_id)).checkpoints
    assert (await rc.list_user_checkpoints_async()).checkpoints
    assert (await rc.get_external_weights_urls_async(S.external_path)).urls
    await rc.publish_checkpoint_from_tinker_path_async(S.sampler_path)
    await rc.unpublish_checkpoint_from_tinker_path_async(S.sampler_path)
    await rc.set_checkpoint_ttl_from_tinker_path_async(S.sampler_path, None)
    assert session_id in (await rc.list_sessions_async()).sessions
    session = await rc.get_session_async(session_id)
    assert (await rc.get_sampler_async(session.sampler_ids[0])).sampler_id == session.sampler_ids[0]
    await rc.assign_session_project_async(session_id, "proj-2")
    gone = (await settle(S.training.save_state_async("gone"))).path
    await rc.delete_checkpoint_from_tinker_path_async(gone)
    await settle(S.training.save_state_async("gone2"))
    await rc.delete_checkpoint_async(run_id, "weights/gone2")
    left = {c.checkpoint_id for c in (await rc.list_checkpoints_async(run_id)).checkpoints}
    assert not {"weights/gone", "weights/gone2"} & left


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/v1/copy_weights"),
        ("POST", "/api/v1/create_custom_loss"),
        ("POST", "/api/v1/auth/token"),
        ("POST", "/api/v1/sessions/search"),
        ("GET", "/api/v1/sessions/s-x/trace_export"),
        ("GET", "/api/v1/audit"),
        ("GET", "/api/v1/billing/usage/events"),
        ("GET", "/api/v1/billing/usage/checkpoints/current"),
    ],
)
def test_what_is_not_offered_answers_501(stack: Stack, method: str, path: str) -> None:
    response = httpx.request(method, stack.base_url + path, headers={"X-API-Key": KEY}, json={})
    assert response.status_code == 501
    body = response.json()
    assert set(body) == {"error", "category"} and "not offered" in body["error"]
    assert response.headers["x-should-retry"] == "false"


def test_flags_that_would_call_what_is_not_offered_stay_off(stack: Stack) -> None:
    config = httpx.post(
        f"{stack.base_url}/api/v1/client/config",
        json={"sdk_version": tinker.__version__},
        headers={"X-API-Key": KEY},
    ).json()
    for flag in ("pjwt_auth_enabled", "custom_loss_server_side", "sample_use_retrieve_futures"):
        assert config[flag] is False, flag


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": KEY}
    tinker_cli = Path(sys.executable).with_name("tinker")
    return subprocess.run(
        [str(tinker_cli), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_cli_checkpoint_list_and_download(stack: Stack, tmp_path: Path) -> None:
    listed = cli(stack, "--format", "json", "checkpoint", "list")
    assert listed.returncode == 0, listed.stderr
    assert S.state_path in {c["tinker_path"] for c in json.loads(listed.stdout)["checkpoints"]}
    for path in (S.state_path, S.external_path):
        out = tmp_path / path.rsplit("/", 1)[-1]
        done = cli(stack, "checkpoint", "download", path, "--output", str(out))
        assert done.returncode == 0, done.stderr
        files = {p.name for p in out.rglob("*") if p.is_file()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    after = json.loads(cli(stack, "--format", "json", "checkpoint", "list").stdout)["checkpoints"]
    assert not [c for c in after if c["tinker_path"].endswith("/external_weights/download")]


def test_close(stack: Stack) -> None:
    S.service.close("success", detail="contract suite done").result()


def test_every_public_method_is_exercised_or_listed(recording: Recorder) -> None:
    surface = recording.surface()
    missing = sorted(surface - recording.called - set(UNSUPPORTED))
    assert not missing, f"SDK methods neither exercised nor listed in UNSUPPORTED: {missing}"
    stale = sorted(set(UNSUPPORTED) - surface)
    assert not stale, f"UNSUPPORTED lists methods this SDK does not have: {stale}"
    exercised_anyway = sorted(set(UNSUPPORTED) & recording.called)
    assert not exercised_anyway, f"listed as unsupported but exercised: {exercised_anyway}"
