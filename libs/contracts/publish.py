"""Publication commands (`tinker.publish.<model>`): trainer -> publisher.

The trainer writes a complete staging directory (atomically, fsynced) and only then hands it
over; the publisher materializes the immutable version, registers it in the catalogue, and
answers the request's future. A command with an `error` says the trainer could not write the
files: the publisher answers the future with that error and publishes nothing.

An ephemeral sampler export (`save_weights_and_get_sampling_client()`) is handed over first: a
command with a `handover` and no files yet goes out as soon as the slot is copied, and the
publisher answers the save with it (a sampling engine on the trainer's host loads the adapter
from the trainer's memory). The same save's files follow in a second command, without
`handover`, once they are fsynced; only that one makes the export durable.
"""

from __future__ import annotations

from typing import Any

import msgspec

from libs.contracts.common import Envelope, LoraConfig

HANDOVER_SEGMENT_PREFIX = "tinkerd-handover-"
"""The file name of every CPU handover segment starts so (then `<pid>-<id>.safetensors`)."""
HANDOVER_SEGMENT_KEY = "tinkerd_segment"
"""The key naming a CPU handover's segment in `AdapterHandover.tensors` (`{key: path}`)."""


class AdapterHandover(msgspec.Struct, kw_only=True, frozen=True):
    """An adapter held in the trainer's memory, readable by a sampling engine on the same host.

    `tensors` is what SGLang's `/load_lora_adapter_from_tensors` takes as one entry of
    `serialized_named_tensors`, base64-encoded: on CUDA, the PEFT tensors (name -> tensor)
    pickled with torch's multiprocessing reductions, which carry a CUDA IPC handle per tensor and
    no data; on CPU, `{"tinkerd_segment": path}` of a safetensors file in shared memory (read by
    Tinkerd's own sampler only). Either way an engine on another host cannot open it (`host`).
    The memory lives as long as the trainer keeps it (services/trainer/handover.py says how
    long); an engine that cannot open it any more says so, and the export's directory serves
    instead once it is durable.
    """

    config: dict[str, Any]  # adapter_config.json
    tensors: str
    host: str  # infra.net.host_id() of the trainer's machine
    device: str  # "cuda" | "cpu": where the tensors live
    nbytes: int


class PublishCommand(Envelope, tag="publish", kw_only=True, frozen=True):
    kind: str  # "training" (save_state) | "sampler" (save_weights_for_sampler)
    staging_dir: str
    base_model: str
    lora: LoraConfig
    step: int = 0
    tinker_path: str | None = None  # named saves
    sampling_session_id: str | None = None  # ephemeral sampler exports
    ttl_s: int | None = None
    user_metadata: dict[str, str] | None = None
    version: str = ""  # unique per save: the unit that produced it
    age_recipients: list[str] | None = None  # encrypt every file to these age recipients
    error: str | None = None  # the staging write failed (a server error, for the caller)
    handover: AdapterHandover | None = None  # an ephemeral export's first command: no files yet
