"""The sampler's HTTP surface: the subset of SGLang's server API that Tinkerd calls.

Routes: ``POST /generate``, ``POST /abort_request``, ``POST /load_lora_adapter``,
``POST /load_lora_adapter_from_tensors``, ``POST /unload_lora_adapter``,
``GET /server_info`` (alias ``/get_server_info``), ``GET /get_model_info`` (alias
``/model_info``), ``GET /health`` and ``GET /health_generate``.  Handlers only translate
(``translate.py``) and delegate to an ``Engine``; errors use SGLang's bodies: 400
``{"error": {"message"}}`` for a bad ``/generate``, 400 ``LoRAUpdateOutput`` with
``success: false`` for a failed adapter call.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import ValidationException

from libs.faults import crash_point
from services.sampler.config import SamplerConfig
from services.sampler.engine import HFEngine
from services.sampler.interface import Engine, RequestError, SequenceRequest
from services.sampler.lora import AdapterError
from services.sampler.translate import to_output, to_sequences
from services.sampler.wire import (
    ErrorBody,
    ErrorResponse,
    GenerateOutput,
    GenerateReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ModelInfo,
    ServerInfo,
    UnloadLoRAAdapterReqInput,
)

VERSION = "tinkerd-cpu-sampler-0.1"
# SGLang reserves a few tokens of the context for internal use; clients reconstruct the
# context length as max_req_input_len + 6, so report it the same way.
SGLANG_INPUT_RESERVE = 6


def _engine(state: State) -> Engine:
    return cast(Engine, state.engine)


def _error(status: int, message: str) -> Response[ErrorResponse]:
    return Response(ErrorResponse(error=ErrorBody(message=message)), status_code=status)


@post("/generate", status_code=200)
async def generate(
    request: Request[Any, Any, Any], data: GenerateReqInput, state: State
) -> GenerateOutput | list[GenerateOutput] | Response[ErrorResponse]:
    """Generate for one prompt or a batch; a list when batched or ``n > 1``.

    As in SGLang, a generation stops when its caller goes away (the connection closes: the
    gateway cancelled the sample) or when ``/abort_request`` names its ``rid``; its rows leave
    the batch at the next step."""
    engine = _engine(state)
    planned, as_list = to_sequences(data)
    work = asyncio.ensure_future(engine.generate([p.sequence for p in planned]))
    gone = asyncio.ensure_future(_disconnected(request))
    rids = [data.rid] if isinstance(data.rid, str) else list(data.rid or [])
    running: dict[str, set[asyncio.Future[Any]]] = state.running
    for rid in rids:
        running.setdefault(rid, set()).add(work)
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()  # the caller went away: stop generating for it
        try:
            results = await work
        except asyncio.CancelledError:
            if _current_cancelled():
                raise
            return _error(400, "request aborted")
    finally:
        gone.cancel()
        for rid in rids:
            running.get(rid, set()).discard(work)
            if not running.get(rid):
                running.pop(rid, None)
    crash_point("sampler.generated")  # fault tests: die mid-request, the answer never sent
    texts = engine.token_texts if data.return_text_in_logprobs else None
    outputs = [to_output(p, r, texts) for p, r in zip(planned, results, strict=True)]
    return outputs if as_list else outputs[0]


class AbortReqInput(msgspec.Struct, kw_only=True):
    """SGLang's ``/abort_request`` body."""

    rid: str = ""
    abort_all: bool = False


@post("/abort_request", status_code=200)
async def abort_request(data: AbortReqInput, state: State) -> dict[str, int]:
    """Stop generating for ``rid`` (or for every request): SGLang's route, for cancelled samples."""
    running: dict[str, set[asyncio.Future[Any]]] = state.running
    rids = list(running) if data.abort_all else [data.rid]
    aborted = 0
    for rid in rids:
        for work in list(running.get(rid, ())):
            aborted += work.cancel()
    return {"aborted": aborted}


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns once the client has closed the connection (the ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _current_cancelled() -> bool:
    """Whether the handler itself is being cancelled (shutdown), not only its generation."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@post("/load_lora_adapter", status_code=200)
async def load_lora_adapter(data: LoadLoRAAdapterReqInput, state: State) -> Response[LoRAUpdateOutput]:
    """Load a PEFT LoRA directory under a new name (400 with ``success: false`` on failure)."""
    engine = _engine(state)
    try:
        await engine.load_adapter(data.lora_name, data.lora_path, pinned=data.pinned)
    except AdapterError as exc:
        return Response(
            LoRAUpdateOutput(success=False, error_message=str(exc), loaded_adapters=engine.adapters()),
            status_code=400,
        )
    return Response(LoRAUpdateOutput(success=True, error_message="", loaded_adapters=engine.adapters()))


@post("/load_lora_adapter_from_tensors", status_code=200)
async def load_lora_adapter_from_tensors(
    data: LoadLoRAAdapterFromTensorsReqInput, state: State
) -> Response[LoRAUpdateOutput]:
    """Load a PEFT LoRA from tensors in another process's memory on this host (SGLang's route and
    fields; one tensor-parallel rank here, so only the first entry is read)."""
    engine = _engine(state)
    try:
        if data.load_format is not None:
            raise AdapterError(f"load_format {data.load_format!r} is not supported (only the default)")
        if data.added_tokens_config:
            raise AdapterError("added_tokens_config is not supported: adapters cannot add tokens")
        if not data.serialized_named_tensors:
            raise AdapterError("serialized_named_tensors is empty")
        await engine.load_adapter_tensors(
            data.lora_name, data.config_dict, data.serialized_named_tensors[0], pinned=data.pinned
        )
    except AdapterError as exc:
        return Response(
            LoRAUpdateOutput(success=False, error_message=str(exc), loaded_adapters=engine.adapters()),
            status_code=400,
        )
    return Response(LoRAUpdateOutput(success=True, error_message="", loaded_adapters=engine.adapters()))


@post("/unload_lora_adapter", status_code=200)
async def unload_lora_adapter(data: UnloadLoRAAdapterReqInput, state: State) -> Response[LoRAUpdateOutput]:
    """Stop serving an adapter; in-flight sequences that use it still complete."""
    engine = _engine(state)
    try:
        await engine.unload_adapter(data.lora_name)
    except AdapterError as exc:
        return Response(
            LoRAUpdateOutput(success=False, error_message=str(exc), loaded_adapters=engine.adapters()),
            status_code=400,
        )
    return Response(LoRAUpdateOutput(success=True, error_message="", loaded_adapters=engine.adapters()))


@get(["/server_info", "/get_server_info"])
async def server_info(state: State) -> ServerInfo:
    """Server arguments and scheduler limits, in SGLang's key names."""
    engine = _engine(state)
    info = engine.info
    return ServerInfo(
        model_path=info.model_path,
        tokenizer_path=info.model_path,
        served_model_name=info.model_path,
        context_length=info.context_length,
        max_total_num_tokens=info.context_length * info.max_batch_size,
        max_req_input_len=info.context_length - SGLANG_INPUT_RESERVE,
        max_req_len=info.context_length - 1,
        max_running_requests=info.max_batch_size,
        enable_lora=True,
        max_lora_rank=info.max_lora_rank,
        max_loaded_loras=info.max_loaded_loras,
        max_loras_per_batch=info.max_batch_size,
        lora_target_modules=info.lora_target_modules,
        lora_eviction_policy="lru",
        loaded_lora_adapters=engine.adapters(),
        resident_lora_adapters=engine.resident_adapters(),
        device=info.device,
        dtype=info.dtype,
        internal_states=[engine.counters()],
        version=VERSION,
    )


@get(["/get_model_info", "/model_info"])
async def model_info(state: State) -> ModelInfo:
    info = _engine(state).info
    return ModelInfo(model_path=info.model_path, tokenizer_path=info.model_path, is_generation=True)


@get("/health")
async def health() -> Response[bytes]:
    """200 once the app is serving (the model is loaded before the app exists)."""
    return Response(b"", status_code=200)


@get("/health_generate")
async def health_generate(state: State) -> Response[bytes]:
    """Generate one token with the base model; 503 if that fails."""
    engine = _engine(state)
    probe = SequenceRequest(
        input_ids=[engine.info.eos_token_ids[0] if engine.info.eos_token_ids else 0],
        max_new_tokens=1,
        temperature=0.0,
    )
    try:
        await engine.generate([probe])
    except Exception as exc:
        return Response(f"generation failed: {type(exc).__name__}: {exc}".encode(), status_code=503)
    return Response(b"", status_code=200)


def _request_error(_: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    return _error(400, str(exc))


def _validation_error(_: Request[Any, Any, Any], exc: ValidationException) -> Response[ErrorResponse]:
    extra = exc.extra if isinstance(exc.extra, list) else [exc.extra] if exc.extra else []
    details = "; ".join(
        str(item.get("message", item)) if isinstance(item, dict) else str(item) for item in extra
    )
    return _error(400, f"{exc.detail}: {details}" if details else str(exc.detail))


def _internal_error(_: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    return _error(500, f"{type(exc).__name__}: {exc}")


def create_app(config: SamplerConfig, engine: Engine | None = None) -> Litestar:
    """The sampler app over ``engine``, or over a new ``HFEngine(config)`` that the app owns.

    An engine passed in is shared (tests, benchmarks) and is not closed on shutdown.
    """
    owned = engine is None
    served: Engine
    if engine is not None:
        served = engine
    elif config.static:
        from services.sampler.static_engine import StaticCacheEngine

        served = StaticCacheEngine(config)
    else:
        served = HFEngine(config)

    def close_engine() -> None:
        if owned:
            served.close()

    return Litestar(
        route_handlers=[
            generate,
            abort_request,
            load_lora_adapter,
            load_lora_adapter_from_tensors,
            unload_lora_adapter,
            server_info,
            model_info,
            health,
            health_generate,
        ],
        state=State({"engine": served, "config": config, "running": {}}),
        exception_handlers={
            RequestError: _request_error,
            AdapterError: _request_error,
            ValidationException: _validation_error,
            500: _internal_error,
        },
        on_shutdown=[close_engine],
        openapi_config=None,
    )
