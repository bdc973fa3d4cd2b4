"""Sample jobs (`tinker.sample.<sampler>`): an accepted asample waiting for a gateway replica to
run it; and sequence records (`tinker.stability.<sequence>`): what a recorded sample produced.

The jobs stream is a work queue consumed by every gateway replica through one shared durable: a
job is acked only after its result is appended, so a replica that dies mid-generation loses
nothing — another (or the restarted one) runs the job again under the same request id.

A sampler asked to record stability information (`record_stability_info`) gets one
`SequenceRecord` per sampled sequence, appended before the sample's result: what a
`stable_reinforce` datum's provenance names, checks against and trains on.
"""

from __future__ import annotations

from libs.contracts.common import Envelope


class SampleJob(Envelope, tag="sample_job", kw_only=True, frozen=True):
    sampler_id: str
    engine_request: bytes  # the SGLang `/generate` body (JSON) minus `lora_path`, fixed at admission
    num_samples: int
    prompt_len: int
    want_prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0
    prompt_logprobs_last_n: int | None = None
    record: bool = False  # record_stability_info: a SequenceRecord per sampled sequence
    session_id: str = ""  # the sampling session's client session (records belong to it)


class SequenceRecord(Envelope, tag="sequence_record", kw_only=True, frozen=True):
    """One recorded sampled sequence. ``touched_ns`` is when it was sampled or last used by an
    accepted training request: it lives one day past that (re-appended on each use)."""

    sequence_id: str
    session_id: str
    sampler_id: str
    snapshot: str  # the sampler export sampled with: its engine adapter name ("" for the base model)
    prompt: bytes  # int32 little-endian, the request's prompt tokens
    tokens: bytes  # int32 little-endian, the sampled tokens
    logprobs: bytes  # float32 little-endian, the engine's logprob of each sampled token
    sampled_ns: int
    touched_ns: int
