"""JSON bodies of the Tinker HTTP API (SDK 0.38, plus the <= 0.24 JSON forms) as msgspec Structs.

Everything the SDK sends or reads as JSON is here; the protobuf half is ``proto``.
Two rules keep the real SDK happy:

- Requests are open-world: unknown fields are ignored (newer SDKs add some), every optional
  field has a default, ``null`` is accepted wherever the SDK may send it, and a request's
  ``type`` field is a msgspec tag, accepted when present and checked when it is.
- Responses are validated by the SDK's pydantic models, so they use ``omit_defaults`` (an
  omitted field takes the SDK's own default) and fields the SDK requires have no default
  here. A ``type``/``status``/``state`` the SDK dispatches on is a tag, written always.
  No future result has an ``error`` key: the SDK reads any payload with one as a failure.

Only ``ClientConfigResponse`` and ``ClientDynamicConfigResponse`` write every field, so the
flags a client runs with do not depend on its version's defaults.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from libs.contracts.common import AdamParams, LoraConfig
from libs.contracts.records import QueueState
from libs.contracts.results import (
    CreateModelResponse as CreateModelResponse,
)
from libs.contracts.results import (
    LoadWeightsResponse as LoadWeightsResponse,
)
from libs.contracts.results import (
    OptimStepResponse as OptimStepResponse,
)
from libs.contracts.results import (
    SaveWeightsExternalResponse as SaveWeightsExternalResponse,
)
from libs.contracts.results import (
    SaveWeightsForSamplerResponse as SaveWeightsForSamplerResponse,
)
from libs.contracts.results import (
    SaveWeightsResponse as SaveWeightsResponse,
)
from libs.contracts.results import (
    UnloadModelResponse as UnloadModelResponse,
)
from services.gateway.wire import proto
from services.gateway.wire import tinker_public_pb2 as pb
from services.gateway.wire.admin_wire import (  # the account and admin schemas, defined once there
    AuthTokenResponse as AuthTokenResponse,
)
from services.gateway.wire.admin_wire import (
    CopyWeightsRequest as CopyWeightsRequest,
)
from services.gateway.wire.admin_wire import (
    CopyWeightsResponse as CopyWeightsResponse,
)
from services.gateway.wire.admin_wire import (
    SearchOwner as SearchOwner,
)
from services.gateway.wire.admin_wire import (
    SessionSearchCursor as SessionSearchCursor,
)
from services.gateway.wire.admin_wire import (
    SessionSearchRequest as SessionSearchRequest,
)
from services.gateway.wire.admin_wire import (
    SessionSearchResponse as SessionSearchResponse,
)
from services.gateway.wire.admin_wire import (
    SessionSummary as SessionSummary,
)
from services.gateway.wire.admin_wire import (
    TraceExportResponse as TraceExportResponse,
)

Metadata = dict[str, Any]
CheckpointType = Literal["training", "sampler", "external"]
_MASK_LOGPROB = -99999.0  # an empty top-k cell: token 0 with this logprob

# --- shared data: model input, tensors, datums ------------------------------------------


class EncodedTextChunk(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="encoded_text"):
    tokens: list[int]


class ImageChunk(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="image"):
    data: bytes  # base64 in JSON
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = None


class ImageAssetPointerChunk(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="image_asset_pointer"
):
    format: Literal["png", "jpeg"]
    location: str
    expected_tokens: int | None = None


class DmelChunk(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="dmel"):
    dmel: bytes  # base64 in JSON


ModelInputChunk = EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk


class ModelInput(msgspec.Struct, frozen=True, kw_only=True):
    chunks: list[ModelInputChunk] = []

    def token_ids(self) -> list[int]:
        """All token ids, chunks concatenated; raises ValueError on a non-text chunk."""
        ids: list[int] = []
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise ValueError(f"prompt has a {type(chunk).__name__}; only text chunks have token ids")
            ids.extend(chunk.tokens)
        return ids


class TensorData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A flattened tensor; sparse CSR when ``sparse_crow_indices`` is set (shape then required)."""

    data: list[int | float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    def to_numpy(self, pad_value: int = 0) -> npt.NDArray[Any]:
        """The dense array; unlisted CSR cells hold ``pad_value``. Raises ValueError on bad shapes."""
        values = np.asarray(self.data, dtype=np.float32 if self.dtype == "float32" else np.int64)
        if self.sparse_crow_indices is not None:
            if self.shape is None or self.sparse_col_indices is None:
                raise ValueError("TensorData: sparse CSR needs shape and sparse_col_indices")
            crow = np.asarray(self.sparse_crow_indices, dtype=np.int64)
            col = np.asarray(self.sparse_col_indices, dtype=np.int64)
            return proto.csr_to_dense(values, crow, col, self.shape, pad_value=pad_value, where="TensorData")
        if self.shape is None:
            return values
        if math.prod(self.shape) != values.size:
            raise ValueError(f"TensorData: shape {self.shape} does not hold {values.size} values")
        return values.reshape(self.shape)

    @classmethod
    def from_numpy(cls, array: npt.ArrayLike) -> TensorData:
        values = np.asarray(array)
        dtype: Literal["int64", "float32"] = "float32" if values.dtype.kind == "f" else "int64"
        return cls(data=values.ravel().tolist(), dtype=dtype, shape=list(values.shape))


class Datum(msgspec.Struct, frozen=True, kw_only=True):
    """A JSON datum (SDK <= 0.24); newer SDKs send datums as protobuf. Provenance spans, which
    those SDKs never send, are the protobuf ones in JSON: ``{"type": "prompt_tokens" |
    "sampled_tokens", "sequence_id", "offset", "length"}``."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = {}
    model_input_spans: list[proto.ProvenanceSpan] | None = None
    loss_fn_input_spans: list[proto.ProvenanceSpan] | None = None


class ForwardBackwardInput(msgspec.Struct, frozen=True, kw_only=True):
    data: list[Datum] = []
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class LegacyForwardBackwardRequest(msgspec.Struct, frozen=True, kw_only=True):
    """JSON ``POST /api/v1/forward_backward`` from SDK <= 0.24 (Content-Type application/json)."""

    forward_backward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None


class LegacyForwardRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /api/v1/forward`` from SDK <= 0.24."""

    forward_input: ForwardBackwardInput
    model_id: str
    seq_id: int | None = None


# --- bootstrap, sessions, telemetry (requests) ------------------------------------------


class ClientConfigRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Body of both ``client/config`` and ``client/dynamic_config``."""

    sdk_version: str = ""


class CreateSessionRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_session"):
    tags: list[str] = []
    user_metadata: Metadata | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="session_heartbeat"
):
    session_id: str


class SessionFinishReason(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["success", "errored", "interrupted"] = "success"


class SessionFinishRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /api/v1/sessions/{id}/finish``."""

    reason: SessionFinishReason = msgspec.field(default_factory=SessionFinishReason)
    detail: str | None = None


class TelemetryEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Any of the four telemetry event kinds; fields of the other kinds stay unset."""

    event: str
    event_id: str = ""
    event_session_index: int = 0
    severity: str = "INFO"
    timestamp: str = ""
    event_name: str | None = None
    event_data: Metadata = {}
    duration: str | None = None
    error_message: str | None = None
    error_type: str | None = None
    traceback: str | None = None


class TelemetrySendRequest(msgspec.Struct, frozen=True, kw_only=True):
    events: list[TelemetryEvent] = []
    platform: str = ""
    sdk_version: str = ""
    session_id: str = ""
    process_uuid: str = ""


class AuthTokenRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /api/v1/auth/token`` (body ``{}``)."""


# --- training (requests) ----------------------------------------------------------------


class OptimizerConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Optimizer family fixed at creation: ``{type: "adamw"}`` or ``{type: "dimuon", version: 1}``."""

    type: str
    version: int | None = None


def _adamw() -> OptimizerConfig:
    return OptimizerConfig(type="adamw")


class CreateModelRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_model"):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: Metadata | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = msgspec.field(default_factory=_adamw)


class GetInfoRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="get_info"):
    model_id: str


class DimuonParams(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "dimuon"
    learning_rate: Annotated[float, msgspec.Meta(ge=0)]
    grad_clip_norm: float = 0.0
    beta1: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9


class OptimStepRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="optim_step"):
    """The SDK sends ``adam_params`` or ``optimizer_params``; ``optim_params`` is its model's own
    name for the field and is accepted too. Use ``params()``."""

    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: DimuonParams | None = None
    optim_params: Metadata | None = None

    def params(self) -> AdamParams | DimuonParams:
        """The step's hyperparameters, by the SDK's precedence: optim_params, adam_params,
        optimizer_params. Raises ValueError (a msgspec.ValidationError) when none is usable."""
        if self.optim_params is not None:
            if self.optim_params.get("type", "adamw") == "adamw":
                return msgspec.convert(self.optim_params, AdamParams)
            return msgspec.convert(self.optim_params, DimuonParams)
        if self.adam_params is not None:
            return self.adam_params
        if self.optimizer_params is not None:
            return self.optimizer_params
        raise ValueError("optim_step carries none of adam_params, optimizer_params, optim_params")


class SaveWeightsRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="save_weights"):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="save_weights_for_sampler"
):
    """Named (``path``) or ephemeral (``sampling_session_seq_id``, no path)."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class SaveWeightsExternalRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="save_weights_external"
):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="load_weights"):
    """Create mode (``session_id`` + ``model_seq_id``) or legacy mode (``model_id`` + ``seq_id``)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: Metadata | None = None
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class CustomLossInput(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    rank: Literal[0, 1, 2]


class CustomLossNode(msgspec.Struct, frozen=True, kw_only=True):
    op: str
    name: str
    target: str
    args: list[Any] = []
    kwargs: Metadata = {}


class CustomLossGraph(msgspec.Struct, frozen=True, kw_only=True):
    format: int = 1
    nodes: list[CustomLossNode] = []


class CreateCustomLossRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_custom_loss"
):
    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[CustomLossInput] = []
    graph: CustomLossGraph = msgspec.field(default_factory=CustomLossGraph)



class UnloadModelRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="unload_model"):
    model_id: str


# --- sampling (requests) ----------------------------------------------------------------


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """``stop``: one string, a list of strings or a list of token ids. ``None`` keeps EOS
    stopping; ``[]`` disables every stop, EOS included."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, list) and len({type(s) for s in self.stop}) > 1:
            raise ValueError("stop mixes strings and token ids")

    @property
    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        return [s for s in self.stop or [] if isinstance(s, int)] if isinstance(self.stop, list) else []


class CreateSamplingSessionRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_sampling_session"
):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SampleRequest(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="sample"):
    prompt: ModelInput
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class JoinSamplingSessionRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="join_sampling_session"
):
    sampling_session_id: str


# --- futures (requests) -----------------------------------------------------------------


class FutureRetrieveRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    allow_metadata_only: bool = False


class SamplingSessionFuturesTarget(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="sampling_session"
):
    sampling_session_id: str
    cloned_sampler_id: int = 0


class FuturesRetrieveRequest(msgspec.Struct, frozen=True, kw_only=True):
    target: SamplingSessionFuturesTarget
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = []


class CancelFutureRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str


# --- checkpoints, runs, sessions (requests) ---------------------------------------------


class WeightsInfoRequest(msgspec.Struct, frozen=True, kw_only=True):
    tinker_path: str


class CheckpointTtlRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``PUT …/checkpoints/{id}/ttl``; ``None`` means never expires."""

    ttl_seconds: int | None = None


class SessionProjectRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``PUT /api/v1/sessions/{id}/project``."""

    project_id: str




# --- futures (responses) ----------------------------------------------------------------


class UntypedAPIFuture(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Answer of every submit endpoint; asample must list one sequence id per sample."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class TryAgainResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="try_again"
):
    request_id: str
    queue_state: QueueState
    queue_state_reason: str | None = None


class CompleteMetadataResponse(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="status", tag="complete_metadata"
):
    """Sent at most once, and only when the poll allowed metadata only."""

    response_payload_size: int


class RequestFailedResponse(msgspec.Struct, frozen=True, kw_only=True):
    """The only future answer with an ``error`` key: the SDK raises RequestFailedError."""

    error: str
    category: Literal["user", "server", "unknown"]


class FutureFinished(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="state", tag="finished"
):
    request_id: str
    response_payload_uncompressed_size: int | None = None


class FutureFailed(msgspec.Struct, frozen=True, kw_only=True, tag_field="state", tag="failed"):
    request_id: str


class FuturesRetrieveResponse(msgspec.Struct, frozen=True, kw_only=True):
    completions: list[FutureFinished | FutureFailed]
    cursor: int


# --- bootstrap, sessions, telemetry (responses) -----------------------------------------


class ClientConfigResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Every flag is written out. The last three are read only by SDKs <= 0.24."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    sample_dispatch_bytes_semaphore_size: int = 10 * 1024 * 1024
    inflight_response_bytes_semaphore_size: int = 50 * 1024 * 1024
    parallel_fwdbwd_chunks: bool = True
    proto_compress_fwdbwd: bool = False
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    fwdbwd_dispatch_bytes_semaphore_size: int = 50_000_000
    billing_exception_max_pause_duration_sec: int = 3600
    sample_no_retries: bool = False
    sample_enable_stuck_detection: bool = True
    sample_max_concurrent_requests: int = 2000
    use_pyqwest_transport: bool = True
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False
    proto_write_fwdbwd: bool = False
    fwd_via_fwdbwd: bool = False
    create_model_via_load_weights: bool = False


class ClientDynamicConfigResponse(msgspec.Struct, frozen=True, kw_only=True):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="create_session"
):
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="session_heartbeat"
):
    pass


class TelemetryResponse(msgspec.Struct, frozen=True, kw_only=True):
    status: Literal["accepted"]


class HealthResponse(msgspec.Struct, frozen=True, kw_only=True):
    status: Literal["ok"]



class SupportedModel(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class GetServerCapabilitiesResponse(msgspec.Struct, frozen=True, kw_only=True):
    supported_models: list[SupportedModel]


# --- training (responses; the non-protobuf future results) ------------------------------



class ModelData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    arch: str | None = None
    model_name: str | None = None  # required in practice: get_tokenizer() reads it
    tokenizer_id: str | None = None


class GetInfoResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="get_info"
):
    model_id: str
    model_data: ModelData
    optimizer_config: OptimizerConfig = msgspec.field(default_factory=_adamw)
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None







class CreateCustomLossResponse(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_custom_loss"
):
    loss_id: str




# --- sampling (responses) ---------------------------------------------------------------


class CreateSamplingSessionResponse(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_sampling_session"
):
    sampling_session_id: str


class GetSamplerResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class JoinSamplingSessionResponse(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="join_sampling_session"
):
    client_counter: int


# --- checkpoints, runs, sessions (responses) --------------------------------------------


class Cursor(msgspec.Struct, frozen=True, kw_only=True):
    offset: int
    limit: int
    total_count: int


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    checkpoint_id: str  # "weights/<name>", "sampler_weights/<name>" or "external_weights/<name>"
    checkpoint_type: CheckpointType
    time: dt.datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: dt.datetime | None = None


class TrainingRun(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: dt.datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(msgspec.Struct, frozen=True, kw_only=True):
    training_runs: list[TrainingRun]
    cursor: Cursor


class CheckpointsListResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class WeightsInfoResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    base_model: str
    is_lora: bool
    optimizer_config: OptimizerConfig = msgspec.field(default_factory=_adamw)
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class ExternalWeightsUrlsResponse(msgspec.Struct, frozen=True, kw_only=True):
    urls: dict[str, str]  # relative file path -> signed URL
    expires: dt.datetime


class ArchiveUrlResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``GET …/checkpoints/{id}/archive`` for SDKs <= 0.35 (or a 302 to ``url``)."""

    url: str
    expires: dt.datetime


class ListSessionsResponse(msgspec.Struct, frozen=True, kw_only=True):
    sessions: list[str]


class GetSessionResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None



# --- JSON results for SDKs <= 0.24 ------------------------------------------------------


class LegacyForwardBackwardOutput(msgspec.Struct, frozen=True, kw_only=True):
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


class LegacySampledSequence(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    stop_reason: Literal["stop", "length"]
    tokens: list[int]
    logprobs: list[float] | None = None


class LegacySampleResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="sample"
):
    sequences: list[LegacySampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_cache_hit_tokens: int = 0


def legacy_forward_backward_output(output: pb.ForwardBackwardOutput) -> LegacyForwardBackwardOutput:
    """The JSON form of a protobuf result, for clients that did not ask for protobuf."""
    datums: list[dict[str, TensorData]] = []
    for record in output.loss_fn_outputs:
        per_field = {name: proto.batched_tensor_datums(bt, name) for name, bt in record.fields.items()}
        count = record.num_datums or len(next(iter(per_field.values()), []))
        datums.extend(
            {name: TensorData.from_numpy(arrays[i]) for name, arrays in per_field.items()}
            for i in range(count)
        )
    return LegacyForwardBackwardOutput(
        loss_fn_output_type=output.loss_fn_output_type.rsplit(":", 1)[-1],
        loss_fn_outputs=datums,
        metrics=dict(output.metrics),
    )


def legacy_sample_response(response: pb.SampleResponse) -> LegacySampleResponse:
    """The JSON form of a protobuf result: NaN prompt logprobs become ``null``, and top-k rows
    lose their padding (a row that is all padding becomes ``null``)."""
    sequences = [
        LegacySampledSequence(
            stop_reason="length" if seq.stop_reason == pb.STOP_REASON_LENGTH else "stop",
            tokens=np.frombuffer(seq.tokens, dtype="<i4").tolist(),
            logprobs=np.frombuffer(seq.logprobs, dtype="<f4").tolist() if seq.HasField("logprobs") else None,
        )
        for seq in response.sequences
    ]
    prompt: list[float | None] | None = None
    if response.HasField("prompt_logprobs"):
        prompt = [
            None if math.isnan(v) else v for v in np.frombuffer(response.prompt_logprobs, "<f4").tolist()
        ]
    topk: list[list[tuple[int, float]] | None] | None = None
    if response.HasField("topk_prompt_logprobs"):
        ids, lps = proto.topk_arrays(response.topk_prompt_logprobs)
        topk = []
        for row_ids, row_lps in zip(ids.tolist(), lps.tolist(), strict=True):
            row = list(zip(row_ids, row_lps, strict=True))
            while row and row[-1] == (0, _MASK_LOGPROB):  # padding fills a row from the right
                row.pop()
            topk.append(row or None)
    return LegacySampleResponse(
        sequences=sequences,
        prompt_logprobs=prompt,
        topk_prompt_logprobs=topk,
        prompt_cache_hit_tokens=response.prompt_cache_hit_tokens,
    )
