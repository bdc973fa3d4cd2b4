"""Every shape ids.py builds is read back by ids.py to what it was built from."""

from __future__ import annotations

import pytest

from libs.contracts import ids, subjects

RUN = "s-1a2b:train:0"


def test_a_tinker_path_is_split_and_parsed_back_into_its_run_kind_and_name() -> None:
    for kind, segment in ids.SEGMENT_OF_KIND.items():
        path = ids.tinker_path(RUN, kind, "ckpt-1")
        assert path == f"tinker://{RUN}/{segment}/ckpt-1"
        assert ids.is_tinker_path(path)
        assert ids.split_path(path) == (RUN, ids.checkpoint_id(kind, "ckpt-1"))
        assert ids.unchecked_path(RUN, segment, "ckpt-1") == path
        assert ids.unchecked_path(RUN, ids.checkpoint_id(kind, "ckpt-1")) == path
        parsed = ids.TinkerPath.parse(path)
        assert (parsed.run, parsed.kind, parsed.name) == (RUN, kind, "ckpt-1")
        assert parsed.key == ids.checkpoint_key(RUN, kind, "ckpt-1")
        assert parsed.key.startswith(ids.run_checkpoints_prefix(RUN))


def test_what_is_not_a_tinker_path_splits_into_nothing_and_an_unchecked_one_is_refused_by_parse() -> None:
    assert ids.split_path("s-1:train:0") == ("", "")
    assert not ids.is_tinker_path("https://example.com/x")
    with pytest.raises(ValueError, match="RUN/"):
        ids.TinkerPath.parse(ids.unchecked_path(RUN, "nope", "ckpt"))
    assert ids.path_shape("training") == "tinker://RUN/weights/NAME"


def test_every_id_minted_under_a_session_names_that_session() -> None:
    model, sampler = ids.model_id("s-9", 2), ids.sampler_id("s-9", 4)
    for minted in (model, sampler, ids.request_id(model, 7), ids.request_id(sampler, 1), ids.unload_request_id(model)):
        assert ids.session_of(minted) == "s-9"
        assert minted.startswith(ids.session_prefix("s-9"))
    assert ids.session_of("s-9") is None
    assert ids.session_of(":train:0") is None
    assert ids.is_sampler_id(sampler) and not ids.is_sampler_id(model)
    assert ids.split_request_id(ids.request_id(sampler, 5)) == (sampler, "5")


def test_keys_and_names_carry_ids_as_tokens() -> None:
    assert ids.untoken(ids.token(RUN)) == RUN
    assert ids.seq_key(RUN, 3) == "s-1a2b=train=0.3"
    assert ids.clones_key("s-1:sample:0") == "s-1=sample=0.clones"
    assert ids.adapter_name(RUN, "ckpt", "u7") == "s-1a2b=train=0.ckpt.u7"
    assert ids.planner_snapshot_name("default") == "planner.default"
    with pytest.raises(ValueError):
        ids.token("not/an id")


def test_a_cancel_subject_names_its_request_back() -> None:
    request = ids.request_id(ids.sampler_id("s-1", 0), 12)
    assert subjects.cancel_request_id(subjects.cancel_subject(request)) == request
