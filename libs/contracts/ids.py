"""Identities, in one place: how every id, key and path Tinkerd mints is built and read back.

- Model ids are `{session}:train:{model_seq_id}` and sampler ids `{session}:sample:{seq}` (the
  SDK computes a model id itself, from the same coordinates); a sampled sequence is
  `{request}:{index}`.
- Request ids are `{owner}:{seq_id}` (owner: a model or a sampling session), taken from the SDK's
  own coordinates so every gateway replica, the planner and the publisher agree on them without
  asking anyone; a model's lifecycle unload is `{model}:unload`.
- `token()` turns an id into one NATS subject token or KV key: `:` becomes `=` (JetStream KV keys
  may not contain `:`, and no id contains `=`, so the mapping is reversible).
- Checkpoints are addressed as `tinker://{run}/{segment}/{name}`; the segment names the kind
  (`weights`: a training checkpoint, `sampler_weights`: a sampler export, `external_weights`: a
  PEFT export for download), `{segment}/{name}` is the SDK's `checkpoint_id`, and the catalogue
  keys them `{token(run)}.{kind}.{name}`. A sampling engine knows a sampler export's version as
  `{token(owner)}.{name}.{version}`.

Nothing outside this module spells these shapes (`tests/infra/test_vocabulary.py` checks it);
paths under the data directory are `libs/checkpoints/layout.py`'s.
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


def session_of(entity_id: str) -> str | None:
    """The session an id was minted under (`s-abc:train:0`, `s-abc:sample:3` and their request
    ids -> `s-abc`); None for anything else."""
    head, sep, _ = entity_id.partition(":")
    return head if sep and head else None


def session_prefix(session_id: str) -> str:
    """The prefix of every id minted under a session: its models, samplers and their requests."""
    return f"{session_id}:"


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


def run_checkpoints_prefix(run: str) -> str:
    """The key prefix, in `tinker_checkpoints`, of every checkpoint of one training run."""
    return f"{token(run)}."


def adapter_name(owner: str, name: str, version: str) -> str:
    """The name a sampling engine knows one version of a sampler export by (`owner`: the training
    run, or the sampling session of an ephemeral export): unique per immutable version, so a name
    never changes weights."""
    return f"{token(owner)}.{name}.{version}"


def handover_msg_id(request_id: str) -> str:
    """The `Nats-Msg-Id` of an ephemeral save's handover command (its files' command, which
    follows, carries the request id itself)."""
    return f"{request_id}.handover"


def planner_snapshot_name(group: str) -> str:
    """The planner's snapshot object in `tinker_snapshots`, named by its trainer group."""
    return f"planner.{token(group)}"


def checkpoint_id(kind: str, name: str) -> str:
    """The SDK's `checkpoint_id` of a checkpoint within its run: `{segment}/{name}`."""
    return f"{SEGMENT_OF_KIND[kind]}/{name}"


def is_tinker_path(value: str) -> bool:
    """True when `value` is spelled as a `tinker://` path (whether or not it names a checkpoint)."""
    return value.startswith(SCHEME)


def unchecked_path(run: str, *parts: str) -> str:
    """`tinker://{run}/{parts...}` as given (a route's pieces, not checked yet): `TinkerPath.parse`
    reads it back and refuses anything that is not a checkpoint's path."""
    return SCHEME + "/".join((run, *parts))


def split_path(path: str) -> tuple[str, str]:
    """(run, checkpoint id) of a `tinker://` path, read without checking the segment or the name;
    ("", "") when `path` is not spelled as one."""
    if not is_tinker_path(path):
        return "", ""
    run, _, rest = path[len(SCHEME) :].partition("/")
    return run, rest


def path_shape(kind: str) -> str:
    """What the paths of one kind look like, for messages: `tinker://RUN/weights/NAME`."""
    return unchecked_path("RUN", SEGMENT_OF_KIND[kind], "NAME")


class TinkerPath(msgspec.Struct, frozen=True):
    """`tinker://{run}/{segment}/{name}`, with `kind` the catalogue's name for the segment."""

    run: str
    kind: str  # "training" | "sampler" | "external"
    name: str

    def __str__(self) -> str:
        return unchecked_path(self.run, checkpoint_id(self.kind, self.name))

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
    """The `tinker://` path of checkpoint `name` of kind `kind` of `run`."""
    return str(TinkerPath(run, kind, name))
