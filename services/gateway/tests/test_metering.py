"""Pure logic behind the admin endpoints: usage folding, audit entries, session timelines, the
Perfetto encoding, JWTs, the SDK-version gate on checkpoint kinds, and the tokenizer cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from libs.contracts.common import LoraConfig
from libs.contracts.events import (
    Audited,
    CheckpointPublished,
    OperationEvent,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    SessionEvent,
)
from libs.contracts.records import CheckpointRecord
from libs.models.hf_cache import install_tokenizer
from services.gateway.accounts import jwt_auth
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog import metering, perfetto
from services.gateway.catalog.catalog import checkpoint_view, knows_external
from services.gateway.http.errors import Unauthorized

H = metering.HOUR_NS
T0 = 1_000 * H  # an hour boundary


def accepted(req: str, tokens: int, at: int, kind: str = "forward_backward", tenant: str = "t1") -> RequestAccepted:
    """An accepted request of the model its request id names (`<model>:<seq_id>`)."""
    model = req.rsplit(":", 1)[0]
    return RequestAccepted(
        kind=kind, num_tokens=tokens, num_datums=1, tenant=tenant, model_id=model, request_id=req, at_ns=at
    )


def sample(req: str, prompt: int, sampled: int, cached: int, at: int) -> RequestCompleted:
    return RequestCompleted(
        kind="sample",
        duration_ms=1.0,
        prompt_tokens=prompt,
        sampled_tokens=sampled,
        cached_tokens=cached,
        tenant="t1",
        model_id="s-b:sample:0",
        request_id=req,
        at_ns=at,
    )


def test_usage_counts_each_request_once_by_hour_type_and_session() -> None:
    events: list[OperationEvent] = [
        accepted("s-a:train:0:1", 10, T0 + 5),
        accepted("s-a:train:0:1", 10, T0 + 6),  # the same request seen twice counts once
        accepted("s-a:train:0:2", 7, T0 + H + 1, kind="forward"),
        accepted("s-a:train:0:3", 99, T0 + 7),
        RequestFailed(kind="forward_backward", error="x", category="user", duration_ms=0, tenant="t1",
                      model_id="s-a:train:0", request_id="s-a:train:0:3", at_ns=T0 + 8),
        accepted("s-a:train:0:9", 1000, T0 + 9, tenant="t2"),  # another tenant's
        sample("s-b:sample:0:1", 6, 8, 2, T0 + 10),
        sample("s-b:sample:0:1", 6, 8, 2, T0 + 11),  # a redelivered sample reported twice
        CheckpointPublished(tinker_path="tinker://s-a:train:0/weights/w", adapter_name="", directory="",
                          tenant="t1", model_id="s-a:train:0", at_ns=T0 + 12),
        CheckpointPublished(tinker_path="s-a:sample:1", adapter_name="", directory="",
                          tenant="t1", model_id="s-a:train:0", at_ns=T0 + 13),  # ephemeral: not a checkpoint
    ]
    totals = metering.fold_usage(events, "t1", T0, T0 + 2 * H)
    assert totals == {
        (T0, "training", "s-a", False): 10,
        (T0 + H, "training", "s-a", False): 7,
        (T0, "sampling_prefill", "s-b", False): 4,
        (T0, "sampling_prefill", "s-b", True): 2,
        (T0, "sampling_sample", "s-b", False): 8,
        (T0, "checkpoint", "s-a", False): 1,
    }
    assert metering.fold_usage(events, "t1", T0 + H, T0 + 2 * H) == {(T0 + H, "training", "s-a", False): 7}
    rows = metering.usage_rows(totals, "tiny-qwen3", "tml:org-user:t1", {"s-a": "p1"})
    assert [r.bucket_start for r in rows] == sorted(r.bucket_start for r in rows)
    first_hour = [r for r in rows if r.bucket_start == metering.at(T0)]
    quantities = [getattr(r.event_info, "token_count", getattr(r.event_info, "count", 0)) for r in first_hour]
    assert quantities == sorted(quantities, reverse=True)
    assert {r.project_id for r in rows if r.session_id == "s-a"} == {"p1"}
    assert {r.project_id for r in rows if r.session_id == "s-b"} == {None}


def test_audit_entries_filter_by_type_tenant_and_day() -> None:
    events: list[OperationEvent] = [
        Audited(resource="checkpoint", action="deleted", subject="tinker://s-a:train:0/weights/w", actor="k1",
                tenant="t1", model_id="s-a:train:0", at_ns=T0 + 3),
        Audited(resource="project", action="session_assigned", subject="s-a", actor="k1",
                details={"project_id": "p"}, tenant="t1", at_ns=T0 + 2),
        Audited(resource="checkpoint", action="read", subject="tinker://s-a:train:0/weights/w", actor="k1",
                details={"purpose": "download"}, tenant="t1", at_ns=T0 + 4),
        SessionEvent(session_id="s-a", what="finished:success", tenant="t1", at_ns=T0 + 5),
        Audited(resource="checkpoint", action="deleted", subject="tinker://x/weights/y", tenant="t2", at_ns=T0 + 1),
        Audited(resource="checkpoint", action="deleted", subject="tinker://x/weights/z", tenant="t1", at_ns=T0 + 5 * H),
    ]
    every = metering.audit_entries(events, "t1", "all", T0, T0 + H)
    assert [e.event for e in every] == ["project_session_assigned", "checkpoint_deleted", "checkpoint_read", "session_finished"]
    assert every[1].tinker_path == "tinker://s-a:train:0/weights/w" and every[1].event_details["actor"] == "k1"
    assert every[2].purpose == "download" and every[3].event_details["reason"] == "success"
    checkpoints = metering.audit_entries(events, "t1", "checkpoints", T0, T0 + H)
    assert [e.event for e in checkpoints] == ["checkpoint_deleted", "checkpoint_read"]
    assert [e.event for e in metering.audit_entries(events, "t1", "projects", T0, T0 + H)] == ["project_session_assigned"]
    assert metering.audit_entries(events, "t1", "teams", T0, T0 + H) == []


def test_session_timeline_is_one_slice_per_request_on_its_runs_track() -> None:
    events: list[OperationEvent] = [
        SessionEvent(session_id="s-a", what="created", tenant="t1", at_ns=T0),
        accepted("s-a:train:0:1", 10, T0 + 100),
        RequestCompleted(kind="forward_backward", duration_ms=0.0, tenant="t1", model_id="s-a:train:0",
                         request_id="s-a:train:0:1", seq_id=1, at_ns=T0 + 900),
        accepted("s-b:train:0:1", 10, T0 + 100),  # another session
    ]
    slices = metering.session_timeline(events, "t1", "s-a")
    assert [(s.track, s.name, s.start_ns, s.end_ns) for s in slices] == [
        ("session", "session created", T0, T0),
        ("s-a:train:0", "forward_backward", T0 + 100, T0 + 900),
    ]
    assert slices[1].args == {"request_id": "s-a:train:0:1", "num_tokens": 10, "num_datums": 1, "outcome": "ok"}


def test_overlapping_requests_of_a_run_go_on_separate_lanes_so_slices_nest() -> None:
    first, second = metering.Slice("s-a:train:0", "forward_backward", 100), metering.Slice("s-a:train:0", "optim_step", 200)
    first.end_ns, second.end_ns = 300, 400  # overlapping, not nested
    packets = [dict(perfetto.fields(body)) for _, body in perfetto.fields(perfetto.encode("s-a", [second, first]))]  # type: ignore[arg-type]
    tracks = {d[1]: d for d in (dict(perfetto.fields(p[60])) for p in packets if 60 in p)}  # type: ignore[arg-type]
    on_track: dict[Any, list[tuple[Any, Any]]] = {}
    for p in packets:
        if 11 in p:
            event = dict(perfetto.fields(p[11]))  # type: ignore[arg-type]
            on_track.setdefault(event[11], []).append((p[8], event[9]))
    assert len(on_track) == 2  # one lane each
    for seq in on_track.values():
        assert [kind for _, kind in seq] == [perfetto.SLICE_BEGIN, perfetto.SLICE_END]
    lane = next(d for d in tracks.values() if d[2] == "s-a:train:0 · 1".encode())
    assert tracks[lane[5]][2] == b"s-a:train:0"  # the lane hangs under its run


def test_perfetto_trace_decodes_to_tracks_and_matched_slices() -> None:
    slices = metering.session_timeline(
        [
            accepted("s-a:train:0:1", 10, T0 + 100),
            RequestCompleted(kind="forward_backward", duration_ms=0.0, tenant="t1", model_id="s-a:train:0",
                             request_id="s-a:train:0:1", at_ns=T0 + 900),
        ],
        "t1",
        "s-a",
    )
    packets: list[dict[int, Any]] = [
        dict(perfetto.fields(body))  # type: ignore[arg-type]
        for _, body in perfetto.fields(perfetto.encode("s-a", slices))
    ]
    assert all(number == 1 for number, _ in perfetto.fields(perfetto.encode("s-a", slices)))
    descriptors = [dict(perfetto.fields(p[60])) for p in packets if 60 in p]
    assert [d[2] for d in descriptors] == [b"session s-a", b"s-a:train:0"]
    assert descriptors[1][5] == descriptors[0][1]  # the run's track hangs under the session's
    events = [(p[8], dict(perfetto.fields(p[11]))) for p in packets if 11 in p]
    assert [(ts, e[9]) for ts, e in events] == [(T0 + 100, perfetto.SLICE_BEGIN), (T0 + 900, perfetto.SLICE_END)]
    assert events[0][1][23] == b"forward_backward" and events[0][1][11] == descriptors[1][1]
    assert all(p[10] == perfetto.SEQUENCE_ID for p in packets)


def test_jwt_round_trip_expiry_and_tampering() -> None:
    tenant = Tenant(id="t1", key_digest="ab" * 32, key_name="ci")
    token = jwt_auth.mint(tenant, b"secret", 60, now=1000.0)
    assert jwt_auth.looks_like_jwt(token)
    back = jwt_auth.verify(token, b"secret", now=1030.0)
    assert back.id == "t1" and back.key_digest == tenant.key_digest[:16] and back.key_name == "ci"
    for secret, now in ((b"other", 1030.0), (b"secret", 1061.0)):
        with pytest.raises(Unauthorized) as refused:
            jwt_auth.verify(token, secret, now=now)
        assert refused.value.headers == jwt_auth.INVALID_TOKEN
    head, claims, sig = token.split(".")
    with pytest.raises(Unauthorized):
        jwt_auth.verify(f"{head}.{claims}x.{sig}", b"secret", now=1030.0)


def test_sdks_before_028_see_external_exports_as_sampler_checkpoints() -> None:
    record = CheckpointRecord(
        tinker_path="tinker://s-a:train:0/external_weights/e", training_run_id="s-a:train:0", kind="external",
        name="e", tenant="t1", base_model="tiny-qwen3", lora=LoraConfig(rank=4), directory="/x", created_ns=T0,
    )
    assert not knows_external({"x-stainless-package-version": "0.24.1"})
    assert knows_external({"x-stainless-package-version": "0.28.0"}) and knows_external({})
    old, new = checkpoint_view(record, external=False), checkpoint_view(record)
    assert (old.checkpoint_type, new.checkpoint_type) == ("sampler", "external")
    assert old.checkpoint_id == new.checkpoint_id == "external_weights/e"


def test_tokenizer_cache_snapshot_is_content_addressed_and_idempotent(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(b"weights")
    cache = tmp_path / "hub"
    first = install_tokenizer(model, ["tiny-x", "org/tiny-x"], cache)
    assert install_tokenizer(model, ["tiny-x", "org/tiny-x"], cache) == first
    assert [p.parent.parent.name for p in first] == ["models--tiny-x", "models--org--tiny-x"]
    for snapshot in first:
        assert sorted(f.name for f in snapshot.iterdir()) == ["config.json", "tokenizer.json"]
        assert (snapshot.parent.parent / "refs" / "main").read_text() == snapshot.name
