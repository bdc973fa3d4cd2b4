"""Contract: the official `tinker` SDK calls every public method of its five clients against the
real stack, on the tiny model, and checks what each one returned or changed.

The surface is found by introspection (`surface.public_methods`): every public callable of
ServiceClient, TrainingClient, SamplingClient, RestClient and AdminClient, `_async` variants
included. Each call is recorded as it happens, and `V(method, condition)` records an assertion on
that method's result or effect; the last test fails for any method that was not both called and
verified (or listed in UNSUPPORTED with a reason), so a newer SDK's new method fails the suite until
it is handled. The stack runs with JWT auth on (`TINKERD_GATEWAY_JWT_AUTH`): the SDK exchanges its
key for a JWT, while the raw HTTP calls below still send the plain API key.

The tests run in file order and share the clients they create (module-scoped state).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import inspect
import json
import logging
import subprocess
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
from tests.harness import JWT_AUTH, SharedStacks, Stack
from tests.sdk import datum
from tests.tinker_cli import run_tinker_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::tinker.lib.experimental.ExperimentalWarning"),
]

KEY = "tml-contract"
OTHER_KEY = "tml-contract-other"
TENANT = "t-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]  # open mode: a key is its own tenant
PROJECT = "proj-contract"

UNSUPPORTED: dict[str, str] = {}
"""Methods not exercised, with the reason (none today: every method of the five clients works)."""

recorder = Recorder(
    [tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient, tinker.AdminClient]
)
V = recorder.verify
S = SimpleNamespace()


@pytest.fixture(scope="module")
def stack(shared_stacks: SharedStacks) -> Stack:
    """The whole stack, with JWT auth offered to SDKs (shared with the other contract module that offers it)."""
    return shared_stacks.get(JWT_AUTH)


@pytest.fixture(scope="module", autouse=True)
def recording() -> Iterator[Recorder]:
    with recorder.install():
        yield recorder


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
        base_url=stack.base_url, api_key=KEY, user_metadata={"suite": "contract"}, project_id=PROJECT
    )
    caps = S.service.get_server_capabilities()
    V("ServiceClient.get_server_capabilities", caps.supported_models[0].model_name == "tiny-qwen3")
    S.session_id = S.service.holder.get_session_id()
    V("ServiceClient.get_console_url", S.session_id in S.service.get_console_url())
    V("ServiceClient.get_telemetry", S.service.get_telemetry() is None, "telemetry is off (TINKER_TELEMETRY=0)")
    rc = S.service.create_rest_client()
    V("ServiceClient.create_rest_client", rc.get_server_capabilities().result() == caps)
    V("RestClient.get_server_capabilities", rc.get_server_capabilities().result().supported_models[0].trainable)


def test_training_client(stack: Stack) -> None:
    tc = S.service.create_lora_training_client(
        base_model="tiny-qwen3", rank=4, seed=0, user_metadata={"renderer_name": "role_colon"}
    ).result()
    S.training = tc
    V("ServiceClient.create_lora_training_client", tc.model_id.startswith(f"{S.session_id}:train:"))
    info = tc.get_info()
    V("TrainingClient.get_info", info.model_data.model_name == "tiny-qwen3" and info.lora_rank == 4)
    V("TrainingClient.get_tokenizer", tc.get_tokenizer().encode("hello"))
    V("TrainingClient.get_console_url", S.session_id in tc.get_console_url())
    V("TrainingClient.get_telemetry", tc.get_telemetry() is None)
    out = tc.forward_backward(DATA, "cross_entropy").result()
    V("TrainingClient.forward_backward", "loss:sum" in out.metrics and len(out.loss_fn_outputs) == 2)
    assert all(key.count(":") == 1 for key in out.metrics)
    forward = tc.forward(DATA, "cross_entropy").result()
    logprobs = forward.loss_fn_outputs[0]["logprobs"].data
    V("TrainingClient.forward", len(logprobs) == 4 and all(lp <= 0 for lp in logprobs))
    stepped = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    V("TrainingClient.optim_step", stepped.metrics is not None and stepped.metrics["optimizer_step"] == 1)
    assert not {"step", "learning_rate"} & set(stepped.metrics), "keys the cookbook writes itself"
    after = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert after != logprobs, "optim_step changed the weights"


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

    custom = S.training.forward_backward_custom(DATA, neg_ll).result()
    V("TrainingClient.forward_backward_custom", custom.metrics["neg_ll:sum"] > 0)
    handle = S.service.create_custom_loss(per_datum, input_ranks={"logprobs": 1, "weights": 1}).result()
    by_handle = S.training.forward_backward_custom(DATA, handle).result()
    V("ServiceClient.create_custom_loss", "loss:sum" in by_handle.metrics and by_handle.metrics["loss:sum"] > 0)
    S.training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_saves(stack: Stack) -> None:
    tc = S.training
    S.state_path = tc.save_state("state1", user_metadata={"step": "2"}).result().path
    S.sampler_path = tc.save_weights_for_sampler("sampler1").result().path
    S.external_path = tc.save_weights_external("export1", ttl_seconds=7200).result().path
    V("TrainingClient.save_state", S.state_path == f"tinker://{tc.model_id}/weights/state1")
    V("TrainingClient.save_weights_for_sampler", S.sampler_path == f"tinker://{tc.model_id}/sampler_weights/sampler1")
    V("TrainingClient.save_weights_external", S.external_path == f"tinker://{tc.model_id}/external_weights/export1")


async def test_training_client_async_variants(stack: Stack) -> None:
    tc = S.training
    V("TrainingClient.get_info_async", (await tc.get_info_async()).model_id == tc.model_id)
    V("TrainingClient.forward_backward_async", (await settle(tc.forward_backward_async(DATA, "cross_entropy"))).metrics["loss:sum"] > 0)
    V("TrainingClient.forward_async", len((await settle(tc.forward_async(DATA, "cross_entropy"))).loss_fn_outputs) == 2)
    custom = await settle(tc.forward_backward_custom_async(DATA, lambda d, lps: (-sum(lp.sum() for lp in lps), {})))
    V("TrainingClient.forward_backward_custom_async", len(custom.loss_fn_outputs) == 2)
    stepped = await settle(tc.optim_step_async(types.AdamParams(learning_rate=1e-3)))
    V("TrainingClient.optim_step_async", stepped.metrics["optimizer_step"] == 3)
    V("TrainingClient.save_state_async", (await settle(tc.save_state_async("state2"))).path.endswith("/weights/state2"))
    V("TrainingClient.save_weights_for_sampler_async", (await settle(tc.save_weights_for_sampler_async("sampler2"))).path.endswith("/sampler_weights/sampler2"))
    V("TrainingClient.save_weights_external_async", (await settle(tc.save_weights_external_async("export2"))).path.endswith("/external_weights/export2"))
    sampler = await settle(tc.save_weights_and_get_sampling_client_async())
    V("TrainingClient.save_weights_and_get_sampling_client_async", len((await settle(sampler.sample_async(PROMPT, 1, PARAMS))).sequences) == 1)
    sampler = await settle(tc.create_sampling_client_async(S.sampler_path))
    V("TrainingClient.create_sampling_client_async", sampler.get_base_model() == "tiny-qwen3")
    V("SamplingClient.get_base_model_async", await sampler.get_base_model_async() == "tiny-qwen3")


def test_load_state_only_as_a_models_first_request(stack: Stack) -> None:
    """As on the hosted service: load_state is a fresh client's first request; later ones are 400."""
    fresh = S.service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    fresh.load_state(S.state_path).result()
    restored = fresh.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    reference = S.service.create_training_client_from_state(S.state_path).result()
    expected = reference.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    V("TrainingClient.load_state", restored == pytest.approx(expected, abs=1e-5))
    with pytest.raises(tinker.BadRequestError, match="LoadWeights is not permitted with seq_id 3"):
        fresh.load_state_with_optimizer(S.state_path).result()
    with_optimizer = S.service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    with_optimizer.load_state_with_optimizer(S.state_path).result()
    with_optimizer.forward_backward(DATA, "cross_entropy").result()
    stepped = with_optimizer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    V("TrainingClient.load_state_with_optimizer", stepped.metrics["optimizer_step"] == 3, "the optimizer step count came back")


async def test_load_state_async_variants(stack: Stack) -> None:
    fresh = await S.service.create_lora_training_client_async(base_model="tiny-qwen3", rank=4)
    await settle(fresh.load_state_async(S.state_path))
    V("TrainingClient.load_state_async", (await settle(fresh.forward_async(DATA, "cross_entropy"))).loss_fn_outputs)
    other = await S.service.create_lora_training_client_async(base_model="tiny-qwen3", rank=4)
    await settle(other.load_state_with_optimizer_async(S.state_path))
    await settle(other.forward_backward_async(DATA, "cross_entropy"))
    stepped = await settle(other.optim_step_async(types.AdamParams(learning_rate=1e-3)))
    V("TrainingClient.load_state_with_optimizer_async", stepped.metrics["optimizer_step"] == 3)


def test_sampling_client(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    sampler = S.training.create_sampling_client(S.sampler_path).result()
    V("TrainingClient.create_sampling_client", sampler.get_base_model() == "tiny-qwen3")
    response = sampler.sample(PROMPT, num_samples=2, sampling_params=PARAMS).result()
    V("SamplingClient.sample", len(response.sequences) == 2 and all(len(seq.logprobs or []) == len(seq.tokens) for seq in response.sequences))
    logprobs = sampler.compute_logprobs(PROMPT).result()
    V("SamplingClient.compute_logprobs", len(logprobs) == 3 and logprobs[0] is None and all(v < 0 for v in logprobs[1:]))
    V("SamplingClient.get_base_model", sampler.get_base_model() == "tiny-qwen3")
    V("SamplingClient.get_telemetry", sampler.get_telemetry() is None)
    with caplog.at_level(logging.WARNING):
        V("SamplingClient.on_queue_state_change", sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "a test") is None)
    V("SamplingClient.on_queue_state_change", "Reason: a test" in caplog.text, "the pause is logged with its reason")
    handle = sampler.get_sampler_handle()
    state = json.loads(base64.urlsafe_b64decode(handle))
    V("SamplingClient.get_sampler_handle", S.session_id in json.dumps(state) and KEY not in handle)
    clone = tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY)
    cloned = clone.sample(PROMPT, 1, PARAMS).result().sequences[0]
    V("SamplingClient.from_sampler_handle", clone.get_base_model() == "tiny-qwen3" and len(cloned.tokens) >= 1)
    ephemeral = S.training.save_weights_and_get_sampling_client().result()
    V("TrainingClient.save_weights_and_get_sampling_client", ephemeral.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens)


def test_sampling_client_on_the_base_model(stack: Stack) -> None:
    base = S.service.create_sampling_client(base_model="tiny-qwen3").result()
    V("ServiceClient.create_sampling_client", base.get_base_model() == "tiny-qwen3")
    tokens = base.get_tokenizer().encode("hello")  # from the local HF cache the gateway filled
    V("SamplingClient.get_tokenizer", tokens == S.training.get_tokenizer().encode("hello"))
    direct = tinker.SamplingClient.create(S.service.holder, model_path=S.sampler_path).result()
    V("SamplingClient.create", direct.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens)


async def test_sampling_async_variants(stack: Stack) -> None:
    sampler = await S.service.create_sampling_client_async(model_path=S.sampler_path)
    V("ServiceClient.create_sampling_client_async", sampler.get_base_model() == "tiny-qwen3")
    V("SamplingClient.sample_async", len((await sampler.sample_async(PROMPT, 1, PARAMS)).sequences) == 1)
    V("SamplingClient.compute_logprobs_async", len(await sampler.compute_logprobs_async(PROMPT)) == 3)
    V("ServiceClient.get_server_capabilities_async", (await S.service.get_server_capabilities_async()).supported_models[0].model_name == "tiny-qwen3")


def test_create_training_clients_from_state(stack: Stack) -> None:
    resumed = S.service.create_training_client_from_state(S.state_path).result()
    V("ServiceClient.create_training_client_from_state", resumed.get_info().lora_rank == 4)
    resumed.forward_backward(DATA, "cross_entropy").result()
    with_optimizer = S.service.create_training_client_from_state_with_optimizer(S.state_path).result()
    with_optimizer.forward_backward(DATA, "cross_entropy").result()
    stepped = with_optimizer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    V("ServiceClient.create_training_client_from_state_with_optimizer", stepped.metrics["optimizer_step"] == 3)


async def test_service_client_async_variants(stack: Stack) -> None:
    created = await S.service.create_lora_training_client_async(base_model="tiny-qwen3", rank=2)
    V("ServiceClient.create_lora_training_client_async", (await created.get_info_async()).lora_rank == 2)
    resumed = await S.service.create_training_client_from_state_async(S.state_path)
    V("ServiceClient.create_training_client_from_state_async", resumed.get_info().lora_rank == 4)
    resumed_opt = await S.service.create_training_client_from_state_with_optimizer_async(S.state_path)
    await settle(resumed_opt.forward_backward_async(DATA, "cross_entropy"))
    stepped = await settle(resumed_opt.optim_step_async(types.AdamParams(learning_rate=1e-3)))
    V("ServiceClient.create_training_client_from_state_with_optimizer_async", stepped.metrics["optimizer_step"] == 3)


def test_rest_client_runs_and_checkpoints(stack: Stack) -> None:
    rc = rest(stack)
    run_id = S.training.model_id
    runs = rc.list_training_runs(limit=50).result()
    V("RestClient.list_training_runs", run_id in {r.training_run_id for r in runs.training_runs})
    run = rc.get_training_run(run_id).result()
    V("RestClient.get_training_run", run.user_metadata == {"renderer_name": "role_colon"} and run.lora_rank == 4)
    assert run.last_checkpoint is not None and run.last_sampler_checkpoint is not None
    V("RestClient.get_training_run_by_tinker_path", rc.get_training_run_by_tinker_path(S.state_path).result().training_run_id == run_id)
    ids = {c.checkpoint_id for c in rc.list_checkpoints(run_id).result().checkpoints}
    V("RestClient.list_checkpoints", {"weights/state1", "sampler_weights/sampler1", "external_weights/export1"} <= ids)
    mine = rc.list_user_checkpoints().result()
    V("RestClient.list_user_checkpoints", S.state_path in {c.tinker_path for c in mine.checkpoints})
    info = rc.get_weights_info_by_tinker_path(S.state_path).result()
    V("RestClient.get_weights_info_by_tinker_path", info.is_lora and info.lora_rank == 4 and info.base_model == "tiny-qwen3")
    urls = rc.get_external_weights_urls(S.external_path).result()
    V("RestClient.get_external_weights_urls", httpx.get(urls.urls["adapter_config.json"]).json()["r"] == 4)


def test_rest_client_publish_ttl_delete(stack: Stack) -> None:
    rc, other = rest(stack), rest(stack, OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(S.sampler_path).result()
    rc.publish_checkpoint_from_tinker_path(S.sampler_path).result()
    V("RestClient.publish_checkpoint_from_tinker_path", other.get_weights_info_by_tinker_path(S.sampler_path).result().lora_rank == 4)
    rc.unpublish_checkpoint_from_tinker_path(S.sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(S.sampler_path).result()
    V("RestClient.unpublish_checkpoint_from_tinker_path", True, "the other tenant gets 404 again (above)")
    rc.set_checkpoint_ttl_from_tinker_path(S.sampler_path, 3600).result()
    listed = {c.tinker_path: c for c in rc.list_checkpoints(S.training.model_id).result().checkpoints}
    V("RestClient.set_checkpoint_ttl_from_tinker_path", listed[S.sampler_path].expires_at is not None)
    rc.set_checkpoint_ttl_from_tinker_path(S.sampler_path, None).result()
    listed = {c.tinker_path: c for c in rc.list_checkpoints(S.training.model_id).result().checkpoints}
    assert listed[S.sampler_path].expires_at is None
    S.doomed = S.training.save_state("doomed").result().path
    rc.delete_checkpoint_from_tinker_path(S.doomed).result()
    with pytest.raises(tinker.NotFoundError):  # deleting what does not exist is a 404
        rc.delete_checkpoint_from_tinker_path(S.doomed).result()
    doomed2 = S.training.save_state("doomed2").result().path
    rc.delete_checkpoint(S.training.model_id, "weights/doomed2").result()
    left = {c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints}
    V("RestClient.delete_checkpoint_from_tinker_path", S.doomed not in left)
    V("RestClient.delete_checkpoint", doomed2 not in left)


def test_rest_client_sessions_and_samplers(stack: Stack) -> None:
    rc = rest(stack)
    V("RestClient.list_sessions", S.session_id in rc.list_sessions(limit=100).result().sessions)
    session = rc.get_session(S.session_id).result()
    V("RestClient.get_session", S.training.model_id in session.training_run_ids and session.sampler_ids)
    sampler = rc.get_sampler(session.sampler_ids[0]).result()
    V("RestClient.get_sampler", sampler.base_model == "tiny-qwen3" and sampler.sampler_id == session.sampler_ids[0])
    rc.assign_session_project(S.session_id, "proj-1").result()
    found = rc.search_sessions(types.SessionSearchRequest(session_id=S.session_id)).result()
    V("RestClient.assign_session_project", found.sessions[0].project_id == "proj-1")
    V("RestClient.get_telemetry", rc.get_telemetry() is None)


def test_whoami_reads_the_jwt_the_sdk_exchanged_its_key_for(stack: Stack) -> None:
    me = rest(stack).whoami().result()
    V("RestClient.whoami", me.org_urn == f"tml:organization:{TENANT}" and me.user_urn.startswith(f"tml:org-user:{TENANT}"))
    config = httpx.post(
        f"{stack.base_url}/api/v1/client/config", json={"sdk_version": tinker.__version__}, headers={"X-API-Key": KEY}
    ).json()
    assert config["pjwt_auth_enabled"] is True
    for flag in ("custom_loss_server_side", "sample_use_retrieve_futures"):  # would call what is not offered
        assert config[flag] is False, flag
    token = httpx.post(f"{stack.base_url}/api/v1/auth/token", json={}, headers={"X-API-Key": KEY}).json()["jwt"]
    by_jwt = httpx.get(f"{stack.base_url}/api/v1/sessions/{S.session_id}", headers={"X-API-Key": token})
    assert by_jwt.status_code == 200  # a JWT and the key it came from name the same tenant
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    refused = httpx.get(f"{stack.base_url}/api/v1/sessions/{S.session_id}", headers={"X-API-Key": forged})
    assert refused.status_code == 401 and 'error="invalid_token"' in refused.headers["www-authenticate"]


def test_search_sessions(stack: Stack) -> None:
    rc = rest(stack)
    page = rc.search_sessions(types.SessionSearchRequest(user_metadata={"suite": "contract"})).result()
    mine = {s.session_id: s for s in page.sessions}
    summary = mine[S.session_id]
    V("RestClient.search_sessions", summary.status is not None and summary.status.type == "active" and summary.checkpoints_count >= 6)
    assert summary.owner.startswith(f"tml:org-user:{TENANT}") and summary.user_metadata == {"suite": "contract"}
    finished = rc.search_sessions(
        types.SessionSearchRequest(statuses=[types.ClientFinishedSessionStatusQuery()])
    ).result()
    assert S.session_id not in {s.session_id for s in finished.sessions}
    assert rest(stack, OTHER_KEY).search_sessions(types.SessionSearchRequest(session_id=S.session_id)).result().sessions == []


def test_copy_weights(stack: Stack) -> None:
    rc = rest(stack)
    copied = S.service.copy_weights(S.sampler_path).result()
    V("ServiceClient.copy_weights", copied.endswith("/sampler_weights/sampler1") and copied != S.sampler_path)
    sampler = S.service.create_sampling_client(model_path=copied).result()
    assert sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens  # the copy's files serve
    run = rc.get_training_run_by_tinker_path(copied).result()
    assert run.training_run_id != S.training.model_id and run.model_owner == TENANT
    to_project = rc.copy_weights(S.state_path, "proj-archive", ttl_seconds=7200).result()
    listed = {c.tinker_path: c for c in rc.list_user_checkpoints(limit=1000).result().checkpoints}
    V("RestClient.copy_weights", to_project in listed and listed[to_project].expires_at is not None)
    resumed = S.service.create_training_client_from_state(to_project).result()
    assert resumed.get_info().lora_rank == 4  # a copy restores like its source
    with pytest.raises(tinker.NotFoundError):  # another tenant cannot copy what is not published
        rest(stack, OTHER_KEY).copy_weights(S.state_path, "theirs").result()


async def test_copy_weights_async(stack: Stack) -> None:
    copied = await rest(stack).copy_weights_async(S.external_path, "proj-archive")
    info = rest(stack).get_weights_info_by_tinker_path(copied).result()
    V("RestClient.copy_weights_async", copied.endswith("/external_weights/export1") and info.lora_rank == 4)


def perfetto_packets(trace: bytes) -> list[dict[int, Any]]:
    """A protobuf reader for the Trace messages the test checks (independent of the server's)."""

    def read(data: bytes) -> list[tuple[int, Any]]:
        pos, out = 0, []
        while pos < len(data):
            key, pos = varint(data, pos)
            value: int | bytes
            if key & 7 == 0:
                value, pos = varint(data, pos)
            else:
                assert key & 7 == 2, f"wire type {key & 7}"
                length, pos = varint(data, pos)
                value, pos = data[pos : pos + length], pos + length
            out.append((key >> 3, value))
        return out

    def varint(data: bytes, pos: int) -> tuple[int, int]:
        shift = value = 0
        while True:
            byte = data[pos]
            value |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if byte < 0x80:
                return value, pos

    packets = []
    for number, packet in read(trace):
        assert number == 1  # Trace.packet
        fields = dict(read(packet))
        for sub in (11, 60):  # track_event, track_descriptor
            if sub in fields:
                fields[sub] = dict(read(fields[sub]))
        packets.append(fields)
    return packets


def test_export_session_trace(stack: Stack) -> None:
    url = rest(stack).export_session_trace(S.session_id).result()
    packets = perfetto_packets(httpx.get(url).content)
    tracks = {p[60][1]: p[60][2].decode() for p in packets if 60 in p}
    lanes = {uuid for uuid, name in tracks.items() if name.split(" · ")[0] == S.training.model_id}
    names = {p[11].get(23, b"").decode() for p in packets if 11 in p and p[11].get(11) in lanes}
    V("RestClient.export_session_trace", {"forward_backward", "optim_step", "save_weights"} <= names)
    begins = sum(1 for p in packets if 11 in p and p[11][9] == 1)
    ends = sum(1 for p in packets if 11 in p and p[11][9] == 2)
    assert begins == ends > 0 and all(8 in p for p in packets if 11 in p)


async def test_export_session_trace_async(stack: Stack) -> None:
    url = await rest(stack).export_session_trace_async(S.session_id)
    V("RestClient.export_session_trace_async", httpx.get(url).status_code == 200)


def usage_totals(usage: types.BillingUsageResponse, session_id: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    for row in usage.data:
        if row.session_id == session_id:
            info = row.event_info
            kind = info.type + (":cached" if getattr(info, "cached", False) else "")
            totals[kind] = totals.get(kind, 0) + getattr(info, "token_count", getattr(info, "count", 0))
    return totals


def usage_window() -> tuple[str, str]:
    hour = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=1)
    return hour.isoformat(), (hour + dt.timedelta(hours=3)).isoformat()


def test_billing_usage_meters_what_was_trained_sampled_and_saved(stack: Stack) -> None:
    admin = tinker.AdminClient(base_url=stack.base_url, api_key=KEY)
    start, end = usage_window()
    before = usage_totals(admin.get_billing_usage(start, end).result(), S.session_id)
    assert before["training"] > 0 and before["sampling_sample"] > 0 and before["checkpoint"] >= 6
    sampler = S.training.create_sampling_client(S.sampler_path).result()
    sampled = sampler.sample(PROMPT, num_samples=2, sampling_params=PARAMS).result()
    S.training.forward(DATA, "cross_entropy").result()
    usage = admin.get_billing_usage(start, end).result()
    after = usage_totals(usage, S.session_id)
    generated = sum(len(seq.tokens) for seq in sampled.sequences)
    prefill = lambda totals: totals.get("sampling_prefill", 0) + totals.get("sampling_prefill:cached", 0)  # noqa: E731
    V("AdminClient.get_billing_usage", after["sampling_sample"] - before["sampling_sample"] == generated and prefill(after) - prefill(before) == 3)
    assert after["training"] - before["training"] == 7  # the forward's model-input tokens
    assert usage.sessions[S.session_id].user_metadata == {"suite": "contract"}
    assert {row.base_model for row in usage.data} == {"tiny-qwen3"}
    rest_usage = rest(stack).get_billing_usage(start, end).result()
    V("RestClient.get_billing_usage", usage_totals(rest_usage, S.session_id)["training"] >= after["training"])
    with pytest.raises(tinker.BadRequestError, match="hour boundary"):
        admin.get_billing_usage("2026-01-01T00:30:00Z", "2026-01-01T02:00:00Z").result()


async def test_billing_usage_async_variants(stack: Stack) -> None:
    start, end = usage_window()
    admin, rc = tinker.AdminClient(base_url=stack.base_url, api_key=KEY), rest(stack)
    V("AdminClient.get_billing_usage_async", usage_totals(await admin.get_billing_usage_async(start, end), S.session_id)["training"] > 0)
    V("RestClient.get_billing_usage_async", usage_totals(await rc.get_billing_usage_async(start, end), S.session_id)["training"] > 0)


def test_checkpoint_storage_usage(stack: Stack) -> None:
    admin = tinker.AdminClient(base_url=stack.base_url, api_key=KEY)
    listed = rest(stack).list_user_checkpoints(limit=1000).result().checkpoints
    usage = admin.get_current_checkpoint_storage_usage().result()
    V("AdminClient.get_current_checkpoint_storage_usage", sum(i.checkpoint_count for i in usage.data) == len(listed) and sum(i.size_bytes for i in usage.data) == sum(c.size_bytes or 0 for c in listed))
    archive = admin.get_current_checkpoint_storage_usage(project_id="proj-archive").result()
    assert [i.project_id for i in archive.data] == ["proj-archive"] and archive.data[0].checkpoint_count == 2
    via_rest = rest(stack).get_current_checkpoint_storage_usage(project_id="proj-archive").result()
    V("RestClient.get_current_checkpoint_storage_usage", via_rest.data == archive.data)
    V("AdminClient.get_telemetry", admin.get_telemetry() is None)


async def test_checkpoint_storage_usage_async(stack: Stack) -> None:
    admin, rc = tinker.AdminClient(base_url=stack.base_url, api_key=KEY), rest(stack)
    whole = await admin.get_current_checkpoint_storage_usage_async()
    V("AdminClient.get_current_checkpoint_storage_usage_async", sum(i.checkpoint_count for i in whole.data) > 0)
    via_rest = await rc.get_current_checkpoint_storage_usage_async(project_id="proj-archive")
    V("RestClient.get_current_checkpoint_storage_usage_async", via_rest.data[0].checkpoint_count == 2)


def test_audit_log_says_who_did_what(stack: Stack) -> None:
    admin = tinker.AdminClient(base_url=stack.base_url, api_key=KEY)
    entries = admin.get_audit_log().result().entries
    events = {(e.event, e.tinker_path) for e in entries}
    V("AdminClient.get_audit_log", {("checkpoint_created", S.doomed), ("checkpoint_deleted", S.doomed), ("checkpoint_published", S.sampler_path)} <= events)
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    projects = admin.get_audit_log("projects").result().entries
    assert {e.event for e in projects} == {"project_session_assigned"}
    V("RestClient.get_audit_log", rest(stack).get_audit_log("checkpoints").result().entries[0].event.startswith("checkpoint_"))
    assert tinker.AdminClient(base_url=stack.base_url, api_key=OTHER_KEY).get_audit_log("projects").result().entries == []


async def test_audit_log_async_variants(stack: Stack) -> None:
    admin = tinker.AdminClient(base_url=stack.base_url, api_key=KEY)
    yesterday = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)
    V("AdminClient.get_audit_log_async", (await admin.get_audit_log_async("checkpoints", yesterday)).entries == [])
    V("RestClient.get_audit_log_async", len((await rest(stack).get_audit_log_async()).entries) > 0)


async def test_rest_client_async_variants(stack: Stack) -> None:
    rc, run_id = rest(stack), S.training.model_id
    V("RestClient.list_training_runs_async", run_id in {r.training_run_id for r in (await rc.list_training_runs_async()).training_runs})
    V("RestClient.get_training_run_async", (await rc.get_training_run_async(run_id)).training_run_id == run_id)
    V("RestClient.get_training_run_by_tinker_path_async", (await rc.get_training_run_by_tinker_path_async(S.state_path)).training_run_id == run_id)
    V("RestClient.list_checkpoints_async", S.state_path in {c.tinker_path for c in (await rc.list_checkpoints_async(run_id)).checkpoints})
    V("RestClient.list_user_checkpoints_async", S.state_path in {c.tinker_path for c in (await rc.list_user_checkpoints_async()).checkpoints})
    V("RestClient.get_external_weights_urls_async", "adapter_model.safetensors" in (await rc.get_external_weights_urls_async(S.external_path)).urls)
    other = rest(stack, OTHER_KEY)
    await rc.publish_checkpoint_from_tinker_path_async(S.sampler_path)
    V("RestClient.publish_checkpoint_from_tinker_path_async", other.get_weights_info_by_tinker_path(S.sampler_path).result().lora_rank == 4)
    await rc.unpublish_checkpoint_from_tinker_path_async(S.sampler_path)
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(S.sampler_path).result()
    V("RestClient.unpublish_checkpoint_from_tinker_path_async", True, "the other tenant gets 404 again (above)")
    await rc.set_checkpoint_ttl_from_tinker_path_async(S.sampler_path, 7200)
    listed = {c.tinker_path: c for c in (await rc.list_checkpoints_async(run_id)).checkpoints}
    V("RestClient.set_checkpoint_ttl_from_tinker_path_async", listed[S.sampler_path].expires_at is not None)
    V("RestClient.list_sessions_async", S.session_id in (await rc.list_sessions_async(limit=100)).sessions)
    session = await rc.get_session_async(S.session_id)
    V("RestClient.get_session_async", run_id in session.training_run_ids)
    V("RestClient.get_sampler_async", (await rc.get_sampler_async(session.sampler_ids[0])).sampler_id == session.sampler_ids[0])
    await rc.assign_session_project_async(S.session_id, PROJECT)
    found = rc.search_sessions(types.SessionSearchRequest(session_id=S.session_id)).result()
    V("RestClient.assign_session_project_async", found.sessions[0].project_id == PROJECT)
    gone = (await settle(S.training.save_state_async("gone"))).path
    await rc.delete_checkpoint_from_tinker_path_async(gone)
    await settle(S.training.save_state_async("gone2"))
    await rc.delete_checkpoint_async(run_id, "weights/gone2")
    left = {c.checkpoint_id for c in (await rc.list_checkpoints_async(run_id)).checkpoints}
    V("RestClient.delete_checkpoint_from_tinker_path_async", "weights/gone" not in left)
    V("RestClient.delete_checkpoint_async", "weights/gone2" not in left)


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/api/v1/create_custom_loss"), ("DELETE", "/api/v1/auth/apikey/me")]
)
def test_what_is_not_offered_answers_a_non_retryable_400(stack: Stack, method: str, path: str) -> None:
    response = httpx.request(method, stack.base_url + path, headers={"X-API-Key": KEY}, json={})
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"error", "category"} and "not offered" in body["error"] and body["category"] == "user"
    assert response.headers["x-should-retry"] == "false"


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return run_tinker_cli(stack.base_url, KEY, *args)


def cli_json(stack: Stack, *args: str) -> Any:
    done = cli(stack, "--format", "json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_cli_checkpoint_list_and_download(stack: Stack, tmp_path: Path) -> None:
    listed = cli_json(stack, "checkpoint", "list")
    assert S.state_path in {c["tinker_path"] for c in listed["checkpoints"]}
    for path in (S.state_path, S.external_path):
        out = tmp_path / path.rsplit("/", 1)[-1]
        done = cli(stack, "checkpoint", "download", path, "--output", str(out))
        assert done.returncode == 0, done.stderr
        files = {p.name for p in out.rglob("*") if p.is_file()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    after = cli_json(stack, "checkpoint", "list")["checkpoints"]
    assert not [c for c in after if c["tinker_path"].endswith("/external_weights/download")]


def test_cli_checkpoint_info_publish_ttl_delete(stack: Stack) -> None:
    info = cli_json(stack, "checkpoint", "info", S.state_path)
    assert S.state_path in json.dumps(info)
    assert cli(stack, "checkpoint", "publish", S.sampler_path).returncode == 0
    assert rest(stack, OTHER_KEY).get_weights_info_by_tinker_path(S.sampler_path).result().lora_rank == 4
    assert cli(stack, "checkpoint", "unpublish", S.sampler_path).returncode == 0
    assert cli(stack, "checkpoint", "set-ttl", S.sampler_path, "--ttl", "7200").returncode == 0
    with pytest.raises(tinker.NotFoundError):
        rest(stack, OTHER_KEY).get_weights_info_by_tinker_path(S.sampler_path).result()
    listed = {c.tinker_path: c for c in rest(stack).list_checkpoints(S.training.model_id).result().checkpoints}
    assert listed[S.sampler_path].expires_at is not None
    assert cli(stack, "checkpoint", "set-ttl", S.sampler_path, "--remove").returncode == 0
    listed = {c.tinker_path: c for c in rest(stack).list_checkpoints(S.training.model_id).result().checkpoints}
    assert listed[S.sampler_path].expires_at is None
    doomed = S.training.save_state("cli-doomed").result().path
    done = cli(stack, "checkpoint", "delete", doomed, "--yes")
    assert done.returncode == 0, done.stderr
    assert doomed not in {c.tinker_path for c in rest(stack).list_user_checkpoints(limit=1000).result().checkpoints}


def test_cli_runs_sessions_billing_and_identity(stack: Stack, tmp_path: Path) -> None:
    runs = cli_json(stack, "run", "list", "--limit", "0")
    assert S.training.model_id in json.dumps(runs)
    assert S.training.model_id in json.dumps(cli_json(stack, "run", "info", S.training.model_id))
    assert "tiny-qwen3" in json.dumps(cli_json(stack, "model", "list"))
    assert TENANT in json.dumps(cli_json(stack, "auth", "whoami"))
    start, end = usage_window()
    usage = cli_json(stack, "billing", "usage", start, end)
    assert S.session_id in json.dumps(usage) and "training" in json.dumps(usage)
    storage = cli_json(stack, "billing", "checkpoint-storage")
    assert "proj-archive" in json.dumps(storage)
    trace = tmp_path / "session.pftrace"
    done = cli(stack, "session", "export-trace", S.session_id, "--output", str(trace))
    assert done.returncode == 0, done.stderr
    assert any(60 in p for p in perfetto_packets(trace.read_bytes()))


def test_close(stack: Stack) -> None:
    S.service.close("success", detail="contract suite done").result()
    found = rest(stack).search_sessions(
        types.SessionSearchRequest(session_id=S.session_id, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])])
    ).result()
    V("ServiceClient.close", [s.session_id for s in found.sessions] == [S.session_id])


def test_every_public_method_is_called_and_verified(recording: Recorder) -> None:
    surface = recording.surface()
    missing = sorted(surface - recording.called - set(UNSUPPORTED))
    assert not missing, f"SDK methods neither exercised nor listed in UNSUPPORTED: {missing}"
    unchecked = sorted(surface - recording.verified - set(UNSUPPORTED))
    assert not unchecked, f"SDK methods called without an assertion on their result: {unchecked}"
    phantom = sorted(recording.verified - recording.called)
    assert not phantom, f"verified but never called (a misspelt name?): {phantom}"
    stale = sorted(set(UNSUPPORTED) - surface)
    assert not stale, f"UNSUPPORTED lists methods this SDK does not have: {stale}"
    exercised_anyway = sorted(set(UNSUPPORTED) & recording.called)
    assert not exercised_anyway, f"listed as unsupported but exercised: {exercised_anyway}"
