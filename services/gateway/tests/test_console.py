"""Pure logic behind the console's endpoints: model states, usage per model and day, rates."""

from __future__ import annotations

from libs.contracts.common import LoraConfig
from libs.contracts.events import (
    OperationEvent,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
)
from libs.contracts.records import ModelQueueRecord, ModelRecord
from services.gateway.catalog import metering
from services.gateway.routes import console

H = metering.HOUR_NS
DAY = 24 * H
T0 = 20_000 * DAY  # a UTC midnight


def model(unloaded: bool = False) -> ModelRecord:
    return ModelRecord(
        model_id="s-a:train:0",
        tenant="t1",
        session_id="s-a",
        base_model="tiny-qwen3",
        lora=LoraConfig(rank=4),
        created_ns=T0,
        create_request_id="s-a:train:0:0",
        unloaded=unloaded,
    )


def plan(slot: int | None, queued: int = 0, paged: bool = False, closed: bool = False) -> ModelQueueRecord:
    return ModelQueueRecord(model_id="s-a:train:0", slot=slot, queued=queued, buffered=0, paged=paged, closed=closed)


def test_model_states_follow_the_planner_record_the_queue_and_failures() -> None:
    state = console._model_state
    assert state(model(), plan(3), None, False) == "resident"
    assert state(model(), plan(3, queued=2), None, False) == "training"
    assert state(model(), plan(None, paged=True), None, False) == "paged out"
    assert state(model(), None, None, True) == "queued"
    assert state(model(), None, "no slot", False) == "failed"
    assert state(model(unloaded=True), plan(None), None, False) == "unloaded"
    assert state(model(), plan(None, closed=True), None, False) == "unloaded"


def test_usage_per_model_and_day_sums_to_the_billing_fold() -> None:
    """Summed over models, each day's numbers are the session-keyed fold's (get_billing_usage's)."""
    events: list[OperationEvent] = [
        RequestAccepted(kind="forward_backward", num_tokens=10, tenant="t1", model_id="s-a:train:0", request_id="s-a:train:0:1", at_ns=T0 + H),
        RequestAccepted(kind="forward_backward", num_tokens=7, tenant="t1", model_id="s-a:train:1", request_id="s-a:train:1:1", at_ns=T0 + DAY + H),
        RequestAccepted(kind="forward_backward", num_tokens=5, tenant="t1", model_id="s-a:train:1", request_id="s-a:train:1:2", at_ns=T0 + DAY + 2 * H),
        RequestFailed(kind="forward_backward", error="x", category="user", duration_ms=1, tenant="t1", model_id="s-a:train:1", request_id="s-a:train:1:2", at_ns=T0 + DAY + 2 * H),
        RequestCompleted(kind="sample", duration_ms=1, prompt_tokens=6, sampled_tokens=4, cached_tokens=2, tenant="t1", model_id="s-a:sample:0", request_id="s-a:sample:0:0", at_ns=T0 + 3 * H),
        RequestAccepted(kind="forward_backward", num_tokens=99, tenant="t2", model_id="s-b:train:0", request_id="s-b:train:0:1", at_ns=T0 + H),
    ]
    rows = console._usage_by_model_and_day(events, "t1")
    by_key = {(r["day"], r["model_id"]): r for r in rows}
    day0, day1 = metering.at(T0).date().isoformat(), metering.at(T0 + DAY).date().isoformat()
    assert set(by_key) == {(day0, "s-a:train:0"), (day0, "s-a:sample:0"), (day1, "s-a:train:1")}
    assert by_key[(day0, "s-a:train:0")]["training_tokens"] == 10
    assert by_key[(day1, "s-a:train:1")]["training_tokens"] == 7  # the failed request costs nothing
    sampled = by_key[(day0, "s-a:sample:0")]
    assert (sampled["prefill_tokens"], sampled["prefill_cached_tokens"], sampled["sampled_tokens"]) == (4, 2, 4)
    billed = metering.fold_usage(events, "t1", 0, T0 + 2 * DAY)
    assert sum(r["training_tokens"] for r in rows) == sum(n for (_, kind, _, _), n in billed.items() if kind == "training")


def test_rates_count_the_window_per_kind_and_errors_by_category() -> None:
    now = T0 + H
    old = now - (console.RATE_WINDOW_S + 1) * 1_000_000_000
    events: list[OperationEvent] = [
        RequestAccepted(kind="optim_step", tenant="t1", request_id="r1", at_ns=now - 1),
        RequestCompleted(kind="optim_step", duration_ms=1, tenant="t1", request_id="r1", at_ns=now - 1),
        RequestFailed(kind="forward_backward", error="bad", category="user", duration_ms=1, request_id="r2", at_ns=now - 1),
        RequestFailed(kind="forward_backward", error="boom", category="server", duration_ms=1, request_id="r3", at_ns=old),
        RequestRejected(kind="forward_backward", status=400, error="no", request_id="r4", at_ns=now - 1),
    ]
    rates = console._rates(events, now)
    per_window = console.RATE_WINDOW_S / 60
    assert rates["per_minute"]["optim_step"] == {"accepted": round(1 / per_window, 2), "completed": round(1 / per_window, 2)}
    assert rates["per_minute"]["forward_backward"] == {"failed": round(1 / per_window, 2), "rejected": round(1 / per_window, 2)}
    assert rates["errors_by_category"] == {"rejected 400": 1, "server": 1, "user": 1}
    assert rates["errors_by_category_window"] == {"rejected 400": 1, "user": 1}
