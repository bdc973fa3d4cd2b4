"""The gateway's protobuf decode path against a bare generated parse, on the SDK's own bytes.

Usage: ``.venv/bin/python -m bench.proto_codec [--repeat N]``

The request: 8 datums x 1024 tokens with ``target_tokens`` and ``weights``, encoded by the
SDK's own converter (``tinker.proto.request_conv``). Two decoders turn it into numpy arrays
(tokens, and every loss input):

- ``tinkerd``: ``services.gateway.wire.proto`` (the checked-in generated ``tinker_public_pb2``, then
  the field checks, provenance spans and loss config, and numpy arrays with sizes and shapes
  checked), what ``POST /api/v1/forward_backward`` does before validation against limits;
- ``generated``: the same generated classes with nothing checked: ``ParseFromString``, then
  ``np.frombuffer`` over the same bytes fields.

It also feeds both a request with one corrupted field and prints what each error says. Raw
output goes to ``bench/results/proto_codec/``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.internal import api_implementation
from tinker import types
from tinker.proto import request_conv

from services.gateway.wire import proto
from services.gateway.wire import tinker_public_pb2 as pb

DTYPES = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}


def request_bytes() -> bytes:
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(i, i + 1024))),
            loss_fn_inputs={  # the SDK converts numpy arrays itself
                "target_tokens": np.arange(1024, dtype=np.int64),  # type: ignore[dict-item]
                "weights": np.ones(1024, np.float32),  # type: ignore[dict-item]
            },
        )
        for i in range(8)
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="sess-1:train:0",
        seq_id=7,
    )
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()  # type: ignore[no-any-return]


def decode_tinkerd(body: bytes) -> int:
    request = proto.decode_forward_backward_request(body)
    n = 0
    for datum in request.data:
        n += len(proto.model_input_tokens(datum))
        for tensor in datum.loss_fn_inputs.values():
            n += proto.tensor_to_numpy(tensor).size
    return n


def decode_generated(body: bytes) -> int:
    message = pb.ForwardBackwardRequest()
    message.ParseFromString(body)
    n = 0
    for datum in message.data:
        for chunk in datum.model_input:
            n += np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").size
        for entry in datum.loss_fn_inputs.values():
            n += np.frombuffer(entry.dense, dtype=DTYPES[entry.dtype]).size
    return n


def per_call_ms(fn: Any, body: bytes, repeat: int) -> float:
    fn(body)  # warm
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn(body)
        best = min(best, (time.perf_counter() - start) / repeat * 1000)
    return best


def error_texts(body: bytes) -> dict[str, str]:
    bad = bytearray(body)
    bad[len(bad) // 2] = 0xFF  # a corrupted byte inside one datum
    out = {}
    for name, fn in (("tinkerd", decode_tinkerd), ("generated", decode_generated)):
        try:
            fn(bytes(bad))
            out[name] = "(decoded without an error)"
        except Exception as exc:  # what a client would be told
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results/proto_codec"))
    args = parser.parse_args()
    body = request_bytes()
    assert decode_tinkerd(body) == decode_generated(body)
    result = {
        "request_bytes": len(body),
        "protobuf_runtime": api_implementation.Type(),
        "tinkerd_ms": per_call_ms(decode_tinkerd, body, args.repeat),
        "generated_ms": per_call_ms(decode_generated, body, args.repeat),
        "errors": error_texts(body),
    }
    result["generated_over_tinkerd"] = result["generated_ms"] / result["tinkerd_ms"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
