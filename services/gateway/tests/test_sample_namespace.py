"""Each inflight sampling client is its own KV namespace on the engine: its sample jobs carry its
sampler id as SGLang's `extra_key`, the same across every update of its weights; snapshot
clients send none (their adapter alone keys the engine's prefix cache)."""

from __future__ import annotations

import msgspec
import numpy as np

from libs.contracts.records import SamplerRecord
from services.gateway.accounts.auth import Tenant
from services.gateway.routes.sampling import _sample_job
from services.gateway.wire import tinker_wire as w

TENANT = Tenant(id="t1", key_digest="ab" * 32, key_name="ci")
REQUEST = w.SampleRequest(prompt=w.ModelInput(chunks=[w.EncodedTextChunk(tokens=[5, 6, 7])]))


def sampler(seq: int, inflight: bool) -> SamplerRecord:
    return SamplerRecord(
        sampler_id=f"sess-1:sample:{seq}",
        tenant=TENANT.id,
        session_id="sess-1",
        base_model="tiny-qwen3",
        inflight_model_id="sess-1:train:0" if inflight else None,
        save_seq_id=seq,
    )


def engine_body(record: SamplerRecord) -> dict[str, object]:
    job = _sample_job(TENANT, record, 0, REQUEST, np.array([5, 6, 7]), 4)
    return msgspec.json.decode(job.engine_request)


def test_inflight_clients_have_their_own_namespace_and_snapshot_clients_none() -> None:
    first, second = engine_body(sampler(1, inflight=True)), engine_body(sampler(2, inflight=True))
    assert first["extra_key"] == "sess-1:sample:1"
    assert second["extra_key"] == "sess-1:sample:2"
    assert "extra_key" not in engine_body(sampler(3, inflight=False))
    assert {k: v for k, v in first.items() if k != "extra_key"} == engine_body(sampler(3, inflight=False))
