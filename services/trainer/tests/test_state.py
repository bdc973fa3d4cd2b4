"""Slot state round trips bit for bit; the PEFT export computes what the engine computes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.engine import AdamParams, DatumInput, EngineConfig, LoraConfig, TrainerEngine
from services.trainer.tests.helpers import ReferenceLoRAModel, ce_datum, random_tokens, randomize_slot
from tests.numerics import assert_within

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)

HP = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=5.0)


def _train(engine: TrainerEngine, slot: int, steps: range) -> None:
    for step in steps:
        rng = np.random.default_rng(100 + step)
        engine.forward_backward([ce_datum(rng, slot, 7), ce_datum(rng, slot, 4)], "cross_entropy")
        assert engine.optim_step({slot: HP})[slot].applied


def test_state_round_trip_continues_bit_identically(engine: TrainerEngine, qwen_dir: Path) -> None:
    """Train 2 steps, export, import into a fresh engine, train 2 more == 4 uninterrupted steps."""
    engine.init_slot(0, LoraConfig(rank=4, seed=7, train_mlp=False))
    _train(engine, 0, range(2))
    saved = engine.get_slot_state(0)
    _train(engine, 0, range(2, 4))
    uninterrupted = engine.get_slot_state(0)

    fresh = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8))
    fresh.set_slot_state(2, saved, with_optimizer=True)
    _train(fresh, 2, range(2, 4))
    resumed = fresh.get_slot_state(2)

    assert resumed.step == uninterrupted.step == 4
    assert resumed.config == uninterrupted.config
    for table in ("adapter", "exp_avg", "exp_avg_sq"):
        got, want = getattr(resumed, table), getattr(uninterrupted, table)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{table}.{name}"


def test_state_without_optimizer_restarts_adam(engine: TrainerEngine) -> None:
    """with_optimizer=False loads the weights only: moments zero, step counter 0."""
    engine.init_slot(0, LoraConfig(rank=4, seed=7))
    _train(engine, 0, range(2))
    saved = engine.get_slot_state(0)
    engine.set_slot_state(1, saved, with_optimizer=False)
    loaded = engine.get_slot_state(1)
    assert loaded.step == 0
    assert all(torch.equal(loaded.adapter[k], v) for k, v in saved.adapter.items())
    assert all(float(v.abs().max()) == 0 for v in loaded.exp_avg.values())


@pytest.mark.parametrize(
    "config",
    [LoraConfig(rank=4, seed=1), LoraConfig(rank=3, seed=2, train_mlp=False, train_unembed=False)],
    ids=["all-modules", "attn-only"],
)
def test_peft_export_matches_engine_logits(
    config: LoraConfig, engine: TrainerEngine, qwen_dir: Path, tmp_path: Path
) -> None:
    """peft.PeftModel on the HF model with the exported adapter gives the engine's logits."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    randomize_slot(engine, 1, config, seed=9, std=0.1)
    tensors, adapter_config = engine.export_peft(1)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config))

    expected_targets = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if config.train_mlp:
        expected_targets |= {"gate_proj", "up_proj", "down_proj"}
    if config.train_unembed:
        expected_targets.add("lm_head")
    assert set(adapter_config["target_modules"]) == expected_targets
    assert adapter_config["r"] == config.rank and adapter_config["lora_alpha"] == 32
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors

    # PEFT in float64 is the reference; the bound is the fp32 forward's (tests.numerics), with the
    # magnitudes from the plain-torch LoRA reference of the same adapter
    base = AutoModelForCausalLM.from_pretrained(str(qwen_dir), dtype=torch.float32).double()
    peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    ref = ReferenceLoRAModel(qwen_dir, tensors, config)
    rng = np.random.default_rng(4)
    docs = [random_tokens(rng, n)[0] for n in (9, 5)]
    got = engine.logits([DatumInput(1, d) for d in docs])
    with torch.no_grad():
        for doc, logits in zip(docs, got, strict=True):
            want = peft_model(torch.from_numpy(doc)[None]).logits[0]  # [N, V]
            ref.logits(doc)
            assert_within(logits, want, ref.logit_bound(len(doc)), "peft logits")
    # The adapter actually changes the model.
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(torch.from_numpy(docs[0])[None]).logits[0]
    assert float((plain - got[0]).abs().max()) > 1e-2


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_an_older_lora_shape_is_refused_naming_its_format(
    version: int, engine: TrainerEngine, tmp_path: Path
) -> None:
    """A save_state checkpoint of format 1 or 2 (one A shared by q/k/v and by gate/up) cannot be
    resumed by the per-projection LoRA: reading it raises a ValueError that names its format and
    says why, before any tensor is loaded."""
    import msgspec

    from libs.checkpoints import state_format as fmt
    from services.trainer.state.checkpoints import read_training_state, training_state_files

    engine.init_slot(0, LoraConfig(rank=2, seed=1))
    state = engine.get_slot_state(0)
    meta = fmt.TrainingStateMeta(base_model="m", model_id="x", tenant="t", lora=state.config, step=0)
    for name, data in training_state_files(state, meta).items():
        with open(tmp_path / name, "wb") as handle:
            if isinstance(data, bytes):
                handle.write(data)
            else:
                data.write_to(handle, lambda: None)
    doc = msgspec.json.decode((tmp_path / fmt.STATE_FILE).read_bytes())
    doc["format_version"] = version
    if version == 1:  # format 1 spelled the LoRA config flat
        doc |= doc.pop("lora")
    (tmp_path / fmt.STATE_FILE).write_bytes(msgspec.json.encode(doc))
    with pytest.raises(ValueError, match=f"checkpoint format {version} predates format 3: .*one A per projection"):
        read_training_state(tmp_path)
    doc["format_version"] = 3
    if version == 1:
        doc["lora"] = {k: doc.pop(k) for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed")}
    (tmp_path / fmt.STATE_FILE).write_bytes(msgspec.json.encode(doc))
    assert read_training_state(tmp_path)[0].adapter.keys() == state.adapter.keys()  # the current one loads


def test_the_adapter_alone_is_the_full_states_adapter_and_exports_the_same(engine: TrainerEngine) -> None:
    """``get_slot_state(with_optimizer=False)`` (what a sampler export copies to the host) holds
    the same config, step and adapter tensors as the full state and no moments, its tensors are
    copies (a later step leaves them unchanged), and the PEFT export made from it is the same."""
    engine.init_slot(1, LoraConfig(rank=4, seed=3))
    _train(engine, 1, range(2))
    full, alone = engine.get_slot_state(1), engine.get_slot_state(1, with_optimizer=False)
    assert (alone.config, alone.step, alone.exp_avg, alone.exp_avg_sq) == (full.config, full.step, {}, {})
    assert set(alone.adapter) == set(full.adapter)
    assert all(torch.equal(alone.adapter[k], v) for k, v in full.adapter.items())
    tensors, config = engine.export_peft(1, alone)
    want_tensors, want_config = engine.export_peft(1)
    assert config == want_config and set(tensors) == set(want_tensors)
    assert all(torch.equal(tensors[k], v) for k, v in want_tensors.items())
    _train(engine, 1, range(2, 3))
    assert all(torch.equal(alone.adapter[k], v) for k, v in full.adapter.items())
