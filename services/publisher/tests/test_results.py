"""What the publisher answers: each save's result is the SDK's own response type for that save,
and every immutable version gets its own engine-side adapter name."""

from __future__ import annotations

import json

import msgspec
import pydantic
import pytest
from tinker import types
from tinker.types.save_weights_external_response import SaveWeightsExternalResponseInternal
from tinker.types.save_weights_for_sampler_response import SaveWeightsForSamplerResponseInternal

from libs.contracts.ids import adapter_name
from services.publisher.service import named_save_result

PATH = "tinker://sess-1:train:0/weights/ckpt"


@pytest.mark.parametrize(
    ("kind", "sdk_type"),
    [
        ("training", types.SaveWeightsResponse),
        ("sampler", SaveWeightsForSamplerResponseInternal),
        ("external", SaveWeightsExternalResponseInternal),
    ],
)
def test_a_named_save_answers_with_the_sdk_response_of_its_kind(kind: str, sdk_type: type[pydantic.BaseModel]) -> None:
    body = json.loads(msgspec.json.encode(named_save_result(kind, PATH, 99)))
    parsed = sdk_type.model_validate(body)
    assert parsed.model_dump()["path"] == PATH
    assert body.get("size_bytes") == (99 if kind == "external" else None)


def test_each_version_has_its_own_adapter_name_usable_as_one_subject_token() -> None:
    first = adapter_name("sess-1:train:0", "ckpt", "u1")
    second = adapter_name("sess-1:train:0", "ckpt", "u2")
    assert first != second
    assert ":" not in first and " " not in first and first.startswith("sess-1=train=0.")
