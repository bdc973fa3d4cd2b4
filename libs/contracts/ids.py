"""Identities, in one place: how every id, key and path Tinkerd mints is built and read back.

- Model ids are `{session}:train:{model_seq_id}` and sampler ids `{session}:sample:{seq}` (the
  SDK computes a model id itself, from the same coordinates); a sampled sequence is
  `{request}:{index}`.
- Request ids are `{owner}:{seq_id}` (owner: a model or a sampling session), taken from the SDK's
  own coordinates so every gateway replica, the planner and the publisher agree on them without
  asking anyone; a model's lifecycle unload is `{model}:unload`.
- `token()` turns an id into one NATS subject token or KV key (`:` becomes `=`).
- Checkpoints are addressed as `tinker://{run}/{segment}/{name}`; the segment names the kind
  (`weights`: a training checkpoint, `sampler_weights`: a sampler export, `external_weights`: a
  PEFT export for download), and the catalogue keys them `{token(run)}.{kind}.{name}`.
"""

from __future__ import annotations

import re

import msgspec

_ID = re.compile(r"^[A-Za-z0-9_:\-]{1,200}$")

HANDOFF = "handoff"
"""`OpOutcome.info` key: the request's result is published by another service (the publisher)."""

SEGMENT_OF_KIND = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
KIND_OF_SEGMENT = {segment: kind for kind, segment in SEGMENT_OF_KIND.items()}
SCHEME = "tinker://"


def is_valid_id(value: str) -> bool:
    """True when `value` could be an id Tinkerd minted (anything else is unknown by construction)."""
    return bool(_ID.match(value))


def token(value: str) -> str:
    """Return `value` as a single subject token / KV key, or raise ValueError if it cannot be one."""
    if not is_valid_id(value):
        raise ValueError(f"not a valid id: {value!r}")
    return value.replace(":", "=")


def untoken(value: str) -> str:
    """Inverse of `token()`."""
    return value.replace("=", ":")


def model_id(session_id: str, model_seq_id: int) -> str:
    """The id of a session's `model_seq_id`-th training model (what the SDK expects back)."""
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, sampling_seq_id: int) -> str:
    """The id of a session's sampling session number `sampling_seq_id`."""
    return f"{session_id}:sample:{sampling_seq_id}"


def session_models_prefix(session_id: str) -> str:
    """The key prefix, in the models bucket, of every model of a session."""
    return token(f"{session_id}:train:")


def session_samplers_prefix(session_id: str) -> str:
    """The key prefix, in the samplers bucket, of every sampling session of a session."""
    return token(f"{session_id}:sample:")


def sequence_id(request: str, index: int) -> str:
    """The `sample_sequence_id` of the `index`-th sequence a sample request returns."""
    return f"{request}:{index}"


def request_id(owner: str, seq_id: int) -> str:
    """The request id of `seq_id` of a model or a sampling session."""
    return f"{owner}:{seq_id}"


def unload_request_id(model_id: str) -> str:
    """The request id of a model's lifecycle unload (unload_model, session finish)."""
    return f"{model_id}:unload"


def page_request_id(model_id: str) -> str:
    """The request id a residency op (page out, page in) carries: it answers no future."""
    return f"{model_id}:page"


def owner_of_request(request: str) -> str:
    """The model (or sampler) a request id belongs to."""
    return request.rsplit(":", 1)[0]


def split_request_id(request: str) -> tuple[str, str]:
    """(owner, seq part) of a request id; the seq part is a number, or `unload`."""
    owner, _, seq = request.rpartition(":")
    return owner, seq


def is_sampler_id(owner: str) -> bool:
    """True for a sampling session's id, False for a model's."""
    return ":sample:" in owner


def seq_key(owner: str, seq_id: int) -> str:
    """The identity-table key of `seq_id` of a model (`tinker_seq`) or sampler (`tinker_sample_seq`)."""
    return f"{token(owner)}.{seq_id}"


def clones_key(sampler_id: str) -> str:
    """`tinker_sample_seq` counter of the clients that joined a sampling session."""
    return f"{token(sampler_id)}.clones"


def checkpoint_key(run: str, kind: str, name: str) -> str:
    """The `tinker_checkpoints` key of a checkpoint."""
    return f"{token(run)}.{kind}.{name}"


class TinkerPath(msgspec.Struct, frozen=True):
    """`tinker://{run}/{segment}/{name}`, with `kind` the catalogue's name for the segment."""

    run: str
    kind: str  # "training" | "sampler" | "external"
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run}/{SEGMENT_OF_KIND[self.kind]}/{self.name}"

    @property
    def key(self) -> str:
        return checkpoint_key(self.run, self.kind, self.name)

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        """Read a path back; ValueError (naming the expected shape) when it is not one."""
        if not path.startswith(SCHEME):
            raise ValueError(f"path {path!r} must start with {SCHEME}")
        parts = path[len(SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] not in KIND_OF_SEGMENT:
            shapes = "|".join(KIND_OF_SEGMENT)
            raise ValueError(f"path {path!r} must look like {SCHEME}RUN/({shapes})/NAME")
        run, segment, name = parts
        return cls(run, KIND_OF_SEGMENT[segment], name)


def tinker_path(run: str, kind: str, name: str) -> str:
    return str(TinkerPath(run, kind, name))
