"""The web console (`GET /console` and `/api/v1/console/...`) on one real stack.

A tenant trains through the official SDK; the console's JSON must show that run, the losses the
SDK itself received, its optimizer steps, checkpoint and usage (the numbers of the billing
endpoint), and nothing of it to another tenant. The browser tests drive the page in headless
Chromium (skipped only where no chromium is installed; CI installs it, see `make install`).
Set TINKERD_CONSOLE_SCREENSHOTS=docs to (re)write docs/console-tenant.png and console-operator.png.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import tinker
from litestar.testing import AsyncTestClient
from tinker import types

from infra.status import collect_status
from services.gateway.accounts.auth import digest
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from tests.harness import Stack

OWNER, OTHER = "tml-console-owner", "tml-console-other"
pytestmark = pytest.mark.slow  # a browser (Chromium) drives the console against a stack

ADMIN_KEY = "console-admin-key"
STEPS = 3
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None, reason="chromium and chromedriver are not installed"
)


def tenant_id(key: str) -> str:
    return f"t-{digest(key)[:16]}"  # open mode: every tml- key is its own tenant


@dataclass
class Trained:
    model_id: str
    session_id: str
    losses: list[float]
    checkpoint: str
    training: Any
    datum: Any
    steps: int = STEPS
    extra: dict[str, Any] = field(default_factory=dict)


def step(trained: Trained) -> None:
    """One forward_backward and one optim_step through the SDK; the loss it received is kept."""
    fb = trained.training.forward_backward([trained.datum], "cross_entropy")
    trained.training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained.losses.append(fb.result().metrics["loss:sum"])


@pytest.fixture(scope="module")
def trained(stack: Stack) -> Trained:
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=OWNER)
    training = client.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    tokens = list(range(5, 21))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
            "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
        },
    )
    run = Trained(training.model_id, client.holder.get_session_id(), [], "", training, datum)
    for _ in range(STEPS):
        step(run)
    run.checkpoint = training.save_state("console-ckpt").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    sampler.sample(types.ModelInput.from_ints(tokens[:6]), num_samples=1, sampling_params=params).result()
    return run


def get(stack: Stack, path: str, key: str | None = OWNER, **params: Any) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.get(f"{stack.base_url}{path}", headers=headers, params=params, timeout=60)


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


# --- the JSON endpoints -------------------------------------------------------------------------

def test_overview_shows_the_run_its_sdk_losses_steps_checkpoint_and_sampler(stack: Stack, trained: Trained) -> None:
    """The caller's run is listed with its state, optimizer steps, the exact losses the SDK got
    back (in seq order), its checkpoint (size, TTL, archive link) and its sampler's activity."""
    view = ok(get(stack, "/api/v1/console/overview"))
    assert view["tenant"] == tenant_id(OWNER)
    (model,) = [m for m in view["models"] if m["model_id"] == trained.model_id]
    assert model["state"] in ("resident", "training", "paged out")
    assert model["optim_steps"] == len(trained.losses) and model["forward_backward"] == len(trained.losses)
    points = sorted(view["loss"][trained.model_id], key=lambda p: p["seq_id"])
    assert [p["loss"] for p in points] == pytest.approx(trained.losses, rel=1e-6)
    (ckpt,) = [c for c in view["checkpoints"] if c["tinker_path"] == trained.checkpoint]
    assert ckpt["size_bytes"] > 0 and ckpt["ttl_s"] is None
    archive = ok(get(stack, ckpt["archive"]))  # the link answers a signed URL for the tar
    assert httpx.get(archive["url"], timeout=60).status_code == 200
    assert any(s["samples"] == 1 and s["sampled_tokens"] > 0 for s in view["samplers"])
    assert trained.session_id in {s["session_id"] for s in view["sessions"]}


def test_usage_equals_the_billing_endpoint(stack: Stack, trained: Trained) -> None:
    """Per-model, per-day usage sums to what GET /api/v1/billing/usage/events reports for the
    same hours (both folded by services.gateway.catalog.metering)."""
    view = ok(get(stack, "/api/v1/console/overview"))
    now = dt.datetime.now(dt.UTC).replace(minute=0, second=0, microsecond=0)
    window = {"starting_on": (now - dt.timedelta(days=1)).isoformat(), "ending_before": (now + dt.timedelta(hours=1)).isoformat()}
    rows = ok(get(stack, "/api/v1/billing/usage/events", **window))["data"]

    def billed(kind: str, cached: bool | None = None) -> int:
        return sum(
            r["event_info"].get("token_count", 0)
            for r in rows
            if r["event_info"]["type"] == kind and (cached is None or r["event_info"].get("cached") == cached)
        )

    usage = view["usage"]
    assert sum(u["training_tokens"] for u in usage) == billed("training") > 0
    assert sum(u["prefill_tokens"] for u in usage) == billed("sampling_prefill", False)
    assert sum(u["prefill_cached_tokens"] for u in usage) == billed("sampling_prefill", True)
    assert sum(u["sampled_tokens"] for u in usage) == billed("sampling_sample") > 0
    assert {u["model_id"] for u in usage if u["training_tokens"]} == {trained.model_id}


def test_another_tenant_sees_none_of_it(stack: Stack, trained: Trained) -> None:
    """Tenant B's overview holds none of tenant A's sessions, models, losses, checkpoints,
    samplers, usage or queue entries, and A's checkpoint download link answers B 404."""
    view = ok(get(stack, "/api/v1/console/overview", key=OTHER))
    assert view["tenant"] == tenant_id(OTHER)
    assert view["models"] == [] and view["loss"] == {} and view["checkpoints"] == []
    assert view["samplers"] == [] and view["usage"] == [] and view["waiting"] == []
    assert trained.session_id not in {s["session_id"] for s in view["sessions"]}
    assert trained.model_id not in json.dumps(view)
    archive = ok(get(stack, "/api/v1/console/overview"))["checkpoints"][0]["archive"]
    assert get(stack, archive, key=OTHER).status_code == 404  # the download link is no way in either


def test_another_tenants_live_stream_carries_none_of_its_events(stack: Stack, trained: Trained) -> None:
    """B's live stream, replayed from the start of the events stream, carries B's own session
    event and no event of A's (A's whole training precedes it in the stream)."""
    seen: list[dict[str, Any]] = []
    session = None
    with httpx.Client(base_url=stack.base_url, timeout=60) as client, client.stream(
        "GET", "/api/v1/console/live", params={"after": 1}, headers={"X-API-Key": OTHER}
    ) as stream:
        assert stream.status_code == 200
        event = ""
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "hello":
                created = client.post("/api/v1/create_session", headers={"X-API-Key": OTHER}, json={"tags": [], "sdk_version": "test"})
                assert created.status_code == 200
                session = created.json()["session_id"]
            elif line.startswith("data:"):
                seen.append(json.loads(line[5:]))
                if seen[-1]["tag"] == "session" and seen[-1]["session_id"] == session:
                    break
    assert seen and {e["tenant"] for e in seen} == {tenant_id(OTHER)}
    assert not any(e["model_id"] == trained.model_id for e in seen)


def test_a_step_appears_on_the_live_stream_with_its_loss(stack: Stack, trained: Trained) -> None:
    """The owner's live stream, opened after a snapshot, carries the next forward_backward's
    completion with the loss the SDK received for it."""
    snapshot = ok(get(stack, "/api/v1/console/overview"))
    step(trained)
    with httpx.Client(base_url=stack.base_url, timeout=60) as client, client.stream(
        "GET", "/api/v1/console/live", params={"after": snapshot["events_seq"]}, headers={"X-API-Key": OWNER}
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event.get("tag") == "completed" and event.get("kind") == "forward_backward":
                    break
    assert event["model_id"] == trained.model_id
    assert event["loss"] == pytest.approx(trained.losses[-1], rel=1e-6)


def test_request_path_by_request_id_and_trace_id(stack: Stack, trained: Trained) -> None:
    """A forward_backward's path reads accepted, planned, started, unit_done, completed, in
    time order from 0 ms, looked up by its request id and by its W3C trace id alike."""
    view = ok(get(stack, "/api/v1/console/overview"))
    request_id = view["loss"][trained.model_id][0]["request_id"]
    path = ok(get(stack, f"/api/v1/console/operator/trace/{request_id}", key=None))
    tags = [s["tag"] for s in path["steps"]]
    for expected in ("accepted", "planned", "started", "unit_done", "completed"):
        assert expected in tags, tags
    assert tags.index("accepted") < tags.index("planned") < tags.index("started") < tags.index("completed")
    times = [s["ms"] for s in path["steps"]]
    assert times[0] == 0 and times == sorted(times)
    traceparent = next(s["traceparent"] for s in path["steps"] if s["tag"] == "accepted")
    assert traceparent, "the accepted event carries the request's trace context"
    by_trace = ok(get(stack, f"/api/v1/console/operator/trace/{traceparent.split('-')[1]}", key=None))
    assert request_id in by_trace["requests"]


def test_operator_overview_and_event_filters(stack: Stack, trained: Trained) -> None:
    """The operator overview carries `tinkerd status`'s trainers and models, request rates per
    kind, and the event filter returns only events of the asked tag and model."""
    view = ok(get(stack, "/api/v1/console/operator/overview", key=None))
    status = msgspec.to_builtins(asyncio.run(collect_status(stack.nats_url)))
    assert {t["trainer_id"] for t in view["status"]["trainers"]} == {t["trainer_id"] for t in status["trainers"]}
    assert trained.model_id in {m["model_id"] for m in view["status"]["models"]}
    assert view["rates"]["per_minute"]["forward_backward"]["completed"] > 0
    events = ok(get(stack, "/api/v1/console/operator/events", key=None, tag="completed", model_id=trained.model_id))["events"]
    assert events and {(e["tag"], e["model_id"]) for e in events} == {("completed", trained.model_id)}
    assert get(stack, "/api/v1/console/operator/events", key=None, limit=0).status_code == 400


def test_openapi_documents_the_console_endpoints(stack: Stack) -> None:
    paths = ok(httpx.get(f"{stack.base_url}/schema/openapi.json", timeout=60))["paths"]
    for path in (
        "/api/v1/console/overview",
        "/api/v1/console/live",
        "/api/v1/console/operator/overview",
        "/api/v1/console/operator/events",
        "/api/v1/console/operator/trace/{ident}",
        "/api/v1/console/operator/live",
    ):
        assert path in paths


TENANT_PATHS = ["/api/v1/console/overview", "/api/v1/console/live"]
OPERATOR_PATHS = [
    "/api/v1/console/operator/overview",
    "/api/v1/console/operator/events",
    "/api/v1/console/operator/trace/r-x",
    "/api/v1/console/operator/live",
]


async def test_unauthenticated_is_401_and_operator_routes_refuse_tenant_keys(stack: Stack) -> None:
    """Through a second gateway replica whose client is not loopback: tenant endpoints without a
    key are 401; operator endpoints refuse a tenant key (403) and answer the admin key."""
    config = GatewayConfig(
        nats_url=stack.nats_url, data_dir=str(stack.data_dir), admin_key=ADMIN_KEY, cache_tokenizer=False
    )
    async with AsyncTestClient(create_app(config)) as client:
        for path in TENANT_PATHS:
            assert (await client.get(path)).status_code == 401, path
            assert (await client.get(path, headers={"X-API-Key": "not-a-key"})).status_code == 401, path
        for path in OPERATOR_PATHS:
            assert (await client.get(path, headers={"X-API-Key": OWNER})).status_code == 403, path
        assert (await client.get(OPERATOR_PATHS[0], headers={"X-Admin-Key": ADMIN_KEY})).status_code == 200
        page = await client.get("/console")
        assert page.status_code == 200 and "<title>Tinkerd console</title>" in page.text
        assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")  # nothing external


# --- the page in a real browser -----------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str) -> None:
    target = os.environ.get("TINKERD_CONSOLE_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(target) / name))


def wait(driver: Any, condition: Any, timeout_s: float = 60) -> Any:
    """Poll ``condition`` until it holds. The page re-renders its live tables on every poll, so an
    element found a moment ago may be gone: such a read is tried again, not failed."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, ignored_exceptions=(StaleElementReferenceException,)).until(condition)


def reread(read: Any) -> Any:
    """``read()``, done again if a live re-render replaced an element it holds between its lookup
    and its use (the page redraws its tables on every poll)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            return read()
        except StaleElementReferenceException:
            continue
    return read()


def text_of(driver: Any, css: str) -> str:
    """The text of the element ``css`` selects, read through `reread`."""
    from selenium.webdriver.common.by import By

    return str(reread(lambda: driver.find_element(By.CSS_SELECTOR, css).text))


def attributes_of(driver: Any, css: str, name: str) -> list[str]:
    """Attribute ``name`` of every element ``css`` selects, in page order, read through `reread`."""
    from selenium.webdriver.common.by import By

    return list(reread(lambda: [e.get_attribute(name) for e in driver.find_elements(By.CSS_SELECTOR, css)]))


@needs_chromium
def test_tenant_view_shows_the_run_its_losses_and_checkpoint_and_updates_live(
    stack: Stack, trained: Trained, browser: Any
) -> None:
    """The page, given the key once, lists the SDK-trained run, draws one point per
    forward_backward with the SDK's losses, lists its checkpoint; a new step appears without a
    reload (a marker set on the window survives)."""
    from selenium.webdriver.common.by import By

    browser.get(f"{stack.base_url}/console")
    browser.execute_script("localStorage.clear()")
    browser.find_element(By.ID, "api-key").send_keys(OWNER)
    browser.find_element(By.ID, "connect").click()
    row = f'#models tr[data-model-id="{trained.model_id}"]'
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row))
    wait(browser, lambda d: d.find_element(By.ID, "tenant-live").text == "live")
    plot = f'.plot[data-model-id="{trained.model_id}"] circle.loss-point'
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, plot)) == len(trained.losses))
    drawn = [float(v) for v in attributes_of(browser, plot, "data-loss")]
    assert drawn == pytest.approx(trained.losses, rel=1e-6)
    assert text_of(browser, f"{row} .model-steps") == str(len(trained.losses))
    ckpt = f'#checkpoints tr[data-path="{trained.checkpoint}"]'
    assert text_of(browser, f"{ckpt} .ckpt-ttl") == "none"
    assert attributes_of(browser, f"{ckpt} a.download", "data-archive")[0].endswith("/archive")
    assert browser.find_elements(By.CSS_SELECTOR, f'#usage tr[data-model-id="{trained.model_id}"]')

    browser.execute_script("window.__notReloaded = true")
    step(trained)
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, plot)) == len(trained.losses))
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"{row} .model-steps").text == str(len(trained.losses)))
    assert browser.execute_script("return window.__notReloaded === true")
    assert float(attributes_of(browser, plot, "data-loss")[-1]) == pytest.approx(
        trained.losses[-1], rel=1e-6
    )
    screenshot(browser, "console-tenant.png")


def settled_status(stack: Stack, timeout_s: float = 60) -> Any:
    """`tinkerd status` once every trainer's heartbeat counts the slots the planner assigned on
    its group (a trainer reports every few seconds, so right after a create it may still show
    the slot free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = asyncio.run(collect_status(stack.nats_url))
        assigned = [m for m in status.planner.values() if m.slot is not None and not m.paged and not m.closed]
        if all(t.slots_used == sum(m.group == t.group for m in assigned) for t in status.trainers):
            return status
        assert time.monotonic() < deadline, f"trainer heartbeats never matched the planner: {status}"
        time.sleep(0.2)  # polling a condition: the next heartbeat


@needs_chromium
def test_operator_view_matches_tinkerd_status(stack: Stack, trained: Trained, browser: Any) -> None:
    """The operator tab shows the trainers (id, slots used/total) and the run's slot and
    residency exactly as `tinkerd status` reads them, and a request's path by its id."""
    from selenium.webdriver.common.by import By

    status = settled_status(stack)  # the page and this read then see the same heartbeat
    browser.get(f"{stack.base_url}/console")
    browser.find_element(By.ID, "tab-operator").click()
    wait(browser, lambda d: d.find_element(By.ID, "op-live").text == "live")
    for trainer in status.trainers:
        cells = f'#trainers tr[data-trainer-id="{trainer.trainer_id}"] .trainer-slots'
        assert text_of(browser, cells) == f"{trainer.slots_used}/{trainer.num_slots}"
    plan = status.planner[trained.model_id]
    row = f'#residency tr[data-model-id="{trained.model_id}"]'
    assert text_of(browser, f"{row} .model-slot") == str(plan.slot)
    expected = "paged" if plan.paged else "resident"
    assert text_of(browser, f"{row} .model-residency") == expected
    for name in status.streams:
        assert browser.find_elements(By.CSS_SELECTOR, f'#streams tr[data-stream="{name}"]')

    request_id = ok(get(stack, "/api/v1/console/overview"))["loss"][trained.model_id][0]["request_id"]
    browser.find_element(By.ID, "trace-id").send_keys(request_id)
    browser.find_element(By.ID, "trace-go").click()
    wait(browser, lambda d: "completed" in [e.text for e in d.find_elements(By.CSS_SELECTOR, "#trace .trace-step")])
    steps = reread(lambda: [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#trace .trace-step")])
    assert steps[0] == "accepted" and "started" in steps
    screenshot(browser, "console-operator.png")
