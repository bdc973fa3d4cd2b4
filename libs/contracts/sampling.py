"""Sample jobs (`tinker.sample.<sampler>`): an accepted asample waiting for a gateway replica to run it.

The stream is a work queue consumed by every gateway replica through one shared durable: a job is
acked only after its result is appended, so a replica that dies mid-generation loses nothing —
another (or the restarted one) runs the job again under the same request id.
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
