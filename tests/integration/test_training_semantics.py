"""Training semantics through the official SDK (and raw HTTP where the SDK cannot misbehave on
purpose) against the running stack: tenant isolation, ordering, poisoned windows, every loss
against a plain-torch reference, non-finite steps, save_state with pending gradients, and
create_model waiting for a slot.

Numbers are fp32 on CPU. They are compared to a float64 reference within the fp32 rounding bound
of ``tests.numerics`` (the magnitudes of the logits' terms come from the float64 base model), and
two fp32 runs of the same training (packed with another tenant or alone, chunks in another order)
to twice that bound: a different packing changes matmul shapes, so fp32 results move by rounding.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import request_conv, response_conv

from tests.harness import Stack
from tests.hf_reference import HFReference
from tests.numerics import U32, assert_within, loss_bound

BASE = "tiny-qwen3"
RANK = 8
PROTOBUF = "application/x-protobuf"
DISCARD_TEXT = "gradients were discarded and no step was applied"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack; retrieve_future answers try_again after 3 s so a waiting create is seen fast."""
    running = Stack(
        tmp_path_factory.mktemp("semantics"), env_overrides={"TINKERD_GATEWAY_RETRIEVE_WAIT_S": "3"}
    )
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def vocab(stack: Stack) -> int:
    from libs.models.registry import resolve_base_model

    return resolve_base_model(BASE, stack.data_dir).vocab_size


# --- data --------------------------------------------------------------------------------------
def tokens(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def td(array: np.ndarray) -> types.TensorData:
    return types.TensorData.from_numpy(array)


def ce_datum(seq: list[int], weights: np.ndarray | None = None) -> types.Datum:
    w = np.ones(len(seq) - 1, dtype=np.float32) if weights is None else weights.astype(np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": td(np.array(seq[1:], dtype=np.int64)), "weights": td(w)},
    )


def batch(rng: np.random.Generator, vocab: int, sizes: tuple[int, ...]) -> list[types.Datum]:
    return [ce_datum(tokens(rng, vocab, n + 1), rng.uniform(0.0, 1.0, n).astype(np.float32)) for n in sizes]


def logprobs(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float32) for o in output.loss_fn_outputs]


def assert_logprobs_close(got: list[np.ndarray], want: list[np.ndarray], bounds: list[torch.Tensor]) -> None:
    assert len(got) == len(want) == len(bounds)
    for a, b, bound in zip(got, want, bounds, strict=True):
        assert_within(a, b, bound, "logprobs")


def service(stack: Stack, tenant: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-{tenant}")


def new_model(stack: Stack, tenant: str, seed: int) -> tinker.TrainingClient:
    return service(stack, tenant).create_lora_training_client(base_model=BASE, rank=RANK, seed=seed).result()


# --- raw HTTP: bodies built by the SDK's own encoder --------------------------------------------
class Raw:
    """Drives one model's seq_ids by hand (the SDK always sends them in order)."""

    def __init__(self, stack: Stack, tenant: str, model_id: str) -> None:
        self.model_id = model_id
        self.http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": f"tml-{tenant}"}, timeout=120)

    def forward_backward(
        self, seq: int, data: list[types.Datum], forward_only: bool = False
    ) -> httpx.Response:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=self.model_id,
            seq_id=seq,
        )
        message = request_conv.forward_backward_request_to_proto(request)
        message.forward_only = forward_only  # what the SDK's forward() does
        body = message.SerializeToString()
        return self.http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTOBUF})

    def optim_step(self, seq: int, learning_rate: float) -> httpx.Response:
        body = {
            "type": "optim_step",
            "model_id": self.model_id,
            "seq_id": seq,
            "adam_params": {"learning_rate": learning_rate},
        }
        return self.http.post("/api/v1/optim_step", json=body)

    def result(self, response: httpx.Response) -> Any:
        """The future's result: a ForwardBackwardOutput, a JSON body, or {"error": ...}."""
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]
        while True:  # the gateway long-polls: no client-side sleeping
            got = self.http.post(
                "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"Accept": PROTOBUF}
            )
            assert got.status_code == 200, got.text
            if PROTOBUF in got.headers.get("content-type", ""):
                return response_conv.deserialize_forward_backward_output(got.content)
            body = got.json()
            if body.get("type") != "try_again":
                return body


# --- (a) tenants train concurrently exactly as they would alone --------------------------------
STEPS = 3
LR = 1e-4


def training_plan(vocab: int, seed: int) -> tuple[list[list[types.Datum]], list[types.Datum]]:
    rng = np.random.default_rng(seed)
    batches = [batch(rng, vocab, (7, 5, 9)) for _ in range(STEPS)]
    probe = batch(rng, vocab, (8, 6))
    return batches, probe


def train(
    training: tinker.TrainingClient,
    batches: list[list[types.Datum]],
    probe: list[types.Datum],
    in_step: threading.Barrier | None = None,
) -> tuple[list[float], list[np.ndarray]]:
    losses = []
    for data in batches:
        if in_step is not None:
            in_step.wait()  # both tenants submit each step together, so their datums share units
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return losses, logprobs(training.forward(probe, "cross_entropy").result())


def test_two_tenants_training_concurrently_match_training_alone(
    stack: Stack, vocab: int, reference_model: Reference
) -> None:
    """Two tenants whose datums share units train as each would alone: step losses and the final
    probe's logprobs within twice the fp32 bound (two fp32 runs of the same training)."""
    tenants = {"alice": 11, "bob": 22}
    plans = {name: training_plan(vocab, seed) for name, seed in tenants.items()}

    concurrent: dict[str, tuple[list[float], list[np.ndarray]]] = {}
    clients = {name: new_model(stack, f"{name}-together", seed) for name, seed in tenants.items()}
    in_step = threading.Barrier(len(tenants))
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            concurrent[name] = train(clients[name], *plans[name], in_step)
        except BaseException as exc:
            errors.append(exc)
            in_step.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in tenants]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors

    for name, seed in tenants.items():
        alone = train(new_model(stack, f"{name}-alone", seed), *plans[name])
        batches, probe = plans[name]
        loss_bounds = [2 * reference_model.ce_loss_bound(b) for b in batches]
        assert_within(concurrent[name][0], alone[0], np.asarray(loss_bounds), f"{name} step losses")
        assert_logprobs_close(concurrent[name][1], alone[1], reference_model.batch_bounds(probe))
    # The steps really moved the weights (the comparison is not between two untouched models).
    assert concurrent["alice"][0][0] != concurrent["alice"][0][-1]


# --- (b) out-of-order and duplicated chunks ---------------------------------------------------
def test_out_of_order_and_duplicated_chunks_equal_in_order(
    stack: Stack, vocab: int, reference_model: Reference
) -> None:
    rng = np.random.default_rng(5)
    chunks = [batch(rng, vocab, (6, 4)), batch(rng, vocab, (5,))]
    probe = batch(rng, vocab, (7,))

    def driven(tenant: str, order: list[int], duplicate: int | None) -> tuple[Raw, list[np.ndarray]]:
        training = new_model(stack, tenant, seed=7)
        assert training.model_id is not None
        raw = Raw(stack, tenant, training.model_id)
        futures = {}
        for seq in order:
            futures[seq] = raw.forward_backward(seq, chunks[seq - 1])
        if duplicate is not None:
            again = raw.forward_backward(duplicate, chunks[duplicate - 1])  # an SDK retry: same bytes
            assert again.json()["request_id"] == futures[duplicate].json()["request_id"]
        step = raw.optim_step(3, learning_rate=1e-3)
        outputs = [raw.result(futures[seq]) for seq in (1, 2)]
        assert all(isinstance(o, types.ForwardBackwardOutput) for o in outputs), outputs
        assert "metrics" in raw.result(step)
        forward = raw.result(raw.forward_backward(4, probe, forward_only=True))
        return raw, logprobs(forward)

    raw, shuffled = driven("ooo", order=[2, 1], duplicate=2)
    _, in_order = driven("in-order", order=[1, 2], duplicate=None)
    assert_logprobs_close(shuffled, in_order, reference_model.batch_bounds(probe))

    # A spent seq_id with different content is a conflict, never a second execution.
    conflict = raw.forward_backward(2, chunks[0])
    assert conflict.status_code == 422, conflict.text
    assert "already used" in conflict.json()["error"]


# --- (c) a poisoned window never applies a partial step ----------------------------------------
def test_a_poisoned_window_discards_its_step_and_the_next_window_trains(stack: Stack, vocab: int) -> None:
    rng = np.random.default_rng(9)
    good = batch(rng, vocab, (6, 5))
    probe = batch(rng, vocab, (7,))
    training = new_model(stack, "poison", seed=3)
    assert training.model_id is not None
    raw = Raw(stack, "poison", training.model_id)

    before = logprobs(raw.result(raw.forward_backward(1, probe, forward_only=True)))
    first = raw.forward_backward(2, good)
    bad = [ce_datum([1, 2, vocab + 5, 3])]  # a token id outside the vocabulary
    refused = raw.forward_backward(3, bad)
    assert refused.status_code == 400, refused.text
    assert f"ids must be in [0, {vocab})" in refused.json()["error"]
    assert raw.forward_backward(3, bad).status_code == 400  # the retry gets the same answer
    step = raw.optim_step(4, learning_rate=1e-2)
    assert isinstance(raw.result(first), types.ForwardBackwardOutput)  # the good chunk itself ran
    failed = raw.result(step)
    assert failed["category"] == "user"
    assert "forward_backward seq_id 3 was rejected" in failed["error"]
    assert DISCARD_TEXT in failed["error"] and "resubmit" in failed["error"]
    after = logprobs(raw.result(raw.forward_backward(5, probe, forward_only=True)))
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)  # not even the good chunk's gradients were applied

    # The next window is clean: it trains.
    raw.result(raw.forward_backward(6, good))
    stepped = raw.result(raw.optim_step(7, learning_rate=1e-2))
    assert stepped["metrics"]["grad_norm"] > 0
    moved = logprobs(raw.result(raw.forward_backward(8, probe, forward_only=True)))
    assert np.abs(moved[0] - before[0]).max() > 1e-3


# --- (d) every loss against a plain-torch reference ------------------------------------------
@pytest.fixture(scope="module")
def reference_model(stack: Stack) -> Reference:
    return Reference(Path(stack.data_dir) / "models" / BASE)


class Reference:
    """The base model in float64 (a fresh adapter has B = 0, so the adapted model is the base
    model), with the fp32 bound of each logprob it computes (``tests.numerics``)."""

    def __init__(self, path: Path) -> None:
        self.hf = HFReference(path)

    def logprobs(self, inputs: list[int], targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of ``targets`` and their fp32 bound."""
        logp, bound = self.hf.logprobs(inputs, None)
        at = (torch.arange(len(targets)), torch.tensor(targets))
        return logp[at], bound[at]

    def batch_bounds(self, data: list[types.Datum]) -> list[torch.Tensor]:
        """Twice the fp32 bound of every datum's logprobs: two fp32 runs of the same training. After
        a few steps at lr 1e-4 the adapter moves the logits' magnitudes by far less than the bound's
        own slack, so the base model's magnitudes stand for the trained model's."""
        out = []
        for d in data:
            target = np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()).tolist()
            out.append(2 * self.logprobs(d.model_input.to_ints(), target)[1])
        return out

    def ce_loss_bound(self, data: list[types.Datum]) -> float:
        """The fp32 bound of the summed cross-entropy loss of ``data`` (``tests.numerics``)."""
        total = 0.0
        for d in data:
            target = np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()).tolist()
            weights = torch.from_numpy(np.asarray(d.loss_fn_inputs["weights"].to_numpy(), np.float64))
            lp, bound = self.logprobs(d.model_input.to_ints(), target)
            total += loss_bound(partial(torch.mul, -weights), lp, bound)  # terms -(w * lp)
        return total


def reference_terms(
    loss_fn: str, lp: torch.Tensor, inputs: dict[str, np.ndarray], config: dict[str, float]
) -> torch.Tensor:
    """Per-token terms of the Tinker loss definitions, written out independently of
    services/trainer/losses.py (the loss is their sum)."""
    t = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in inputs.items() if k != "target_tokens"}
    if loss_fn == "cross_entropy":
        return -(t["weights"] * lp)
    q, adv = t["logprobs"], t["advantages"]
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv)
    if loss_fn == "ppo":
        lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    if loss_fn == "cispo":
        lo, hi = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
        return -(ratio.clamp(lo, hi) * lp * adv)
    if loss_fn == "dro":
        beta = config.get("beta", 0.05)
        return -(lp * adv - 0.5 * beta * (lp - q) ** 2)
    assert loss_fn == "gspo"
    lo, hi = config.get("clip_low_threshold", 1 - 3e-4), config.get("clip_high_threshold", 1 + 4e-4)
    mask = t.get("sequence_ratio_mask", torch.ones_like(lp))
    seq_ratio = torch.exp((mask * (lp - q)).sum() / mask.sum().clamp(min=1.0))
    return -torch.minimum(seq_ratio * adv, seq_ratio.clamp(lo, hi) * adv)


LOSS_CASES: list[tuple[types.LossFnType, dict[str, float]]] = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
]


def test_every_loss_matches_a_plain_torch_reference(stack: Stack, vocab: int, reference_model: Reference) -> None:
    """Logprobs and the summed loss of every loss function equal the float64 reference within the
    fp32 bound (the loss's: the logprobs' bounds through its sensitivity, plus the sum's rounding)."""
    training = new_model(stack, "losses", seed=1)
    rng = np.random.default_rng(13)
    for case, (loss_fn, config) in enumerate(LOSS_CASES):
        data, expected_lp, lp_bounds, expected_loss, bound = [], [], [], 0.0, 0.0
        for n in (9, 6):
            seq = tokens(rng, vocab, n + 1)
            lp, lp_bound = reference_model.logprobs(seq[:-1], seq[1:])
            inputs: dict[str, np.ndarray] = {"target_tokens": np.array(seq[1:], dtype=np.int64)}
            if loss_fn == "cross_entropy":
                inputs["weights"] = rng.uniform(-0.5, 1.5, n).astype(np.float32)
            else:
                # Sampler logprobs near the current ones, so some ratios fall inside and some
                # outside the clip range; advantages of both signs.
                inputs["logprobs"] = (lp.numpy() + rng.normal(0.0, 0.3, n)).astype(np.float32)
                inputs["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
                if loss_fn == "gspo" and case % 2:
                    inputs["sequence_ratio_mask"] = (rng.uniform(size=n) > 0.3).astype(np.float32)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={name: td(value) for name, value in inputs.items()},
                )
            )
            expected_lp.append(lp.numpy())
            lp_bounds.append(lp_bound)
            expected_loss += float(reference_terms(loss_fn, lp, inputs, config).sum())
            terms = partial(reference_terms, loss_fn, inputs=inputs, config=config)
            bound += loss_bound(terms, lp, lp_bound)
        output = training.forward_backward(data, loss_fn, config or None).result()
        assert_logprobs_close(logprobs(output), expected_lp, lp_bounds)
        got = output.metrics["loss:sum"]
        assert_within(got, expected_loss, bound + U32 * abs(expected_loss), f"{loss_fn} {config} loss:sum")


# --- (e) non-finite gradients skip the step ----------------------------------------------------
def test_non_finite_gradients_skip_the_step_and_say_so(stack: Stack, vocab: int) -> None:
    """Weights near the float32 maximum are finite inputs whose gradients overflow to inf/nan in
    the backward pass: the optimizer refuses the step, drops the gradients and keeps the weights."""
    training = new_model(stack, "nonfinite", seed=4)
    rng = np.random.default_rng(17)
    probe = batch(rng, vocab, (7,))
    before = logprobs(training.forward(probe, "cross_entropy").result())
    seq = tokens(rng, vocab, 12)
    huge = ce_datum(seq, np.full(11, 3.0e38, dtype=np.float32))
    training.forward_backward([huge], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert failed.value.category == types.RequestErrorCategory.User
    assert "optimizer step skipped: non-finite gradient norm" in failed.value.message
    assert "weights are unchanged" in failed.value.message
    after = logprobs(training.forward(probe, "cross_entropy").result())
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)
    # The gradients went with the skipped step: the next window starts clean and steps.
    training.forward_backward(batch(rng, vocab, (6,)), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = logprobs(training.forward(probe, "cross_entropy").result())
    assert np.isfinite(moved[0]).all() and np.abs(moved[0] - before[0]).max() > 1e-3


# --- (f) save_state and sampler saves with pending gradients leave them for the next step -----
def test_saves_with_pending_gradients_keep_them_for_the_next_optim_step(stack: Stack, vocab: int) -> None:
    """save_state and save_weights_for_sampler in the middle of a window succeed and save the
    weights as they were before the window; the window's optim_step then applies exactly the
    gradients of a twin model that saved nothing (equal grad_norm, equal weights after)."""
    rng = np.random.default_rng(19)
    window = batch(rng, vocab, (5, 3))
    probe = batch(rng, vocab, (4,))
    saver, twin = new_model(stack, "saver", seed=6), new_model(stack, "saver", seed=6)
    before = logprobs(saver.forward(probe, "cross_entropy").result())
    for training in (saver, twin):
        training.forward_backward(window, "cross_entropy").result()
    saved = saver.save_state("mid-window").result()
    assert saved.path.endswith("/weights/mid-window")
    saver.save_weights_for_sampler("snapshot").result()
    stepped = [t.optim_step(types.AdamParams(learning_rate=1e-2)).result() for t in (saver, twin)]
    assert stepped[0].metrics is not None and stepped[1].metrics is not None
    assert stepped[0].metrics["grad_norm"] > 0
    assert stepped[0].metrics["grad_norm"] == stepped[1].metrics["grad_norm"]
    after = [logprobs(t.forward(probe, "cross_entropy").result()) for t in (saver, twin)]
    np.testing.assert_array_equal(after[0][0], after[1][0])
    assert np.abs(after[0][0] - before[0]).max() > 1e-3
    # The checkpoint holds the weights from before the window's step.
    restored = service(stack, "saver").create_training_client_from_state(saved.path).result()
    np.testing.assert_array_equal(logprobs(restored.forward(probe, "cross_entropy").result())[0], before[0])


# --- (g) top-K cross-entropy through the SDK --------------------------------------------------
def test_top_k_cross_entropy_through_the_sdk(stack: Stack, vocab: int) -> None:
    """(N, K) target_tokens and weights (mostly zero, as top-K distillation sends them) come back
    as (N, K) logprobs whose columns are the one-column logprobs, and loss:sum is -sum w*lp of
    them; the numerics against a float64 reference are services/trainer/tests/test_loss_surface.py."""
    training = new_model(stack, "topk", seed=8)
    rng = np.random.default_rng(23)
    seq = tokens(rng, vocab, 7)
    targets = rng.integers(0, vocab, (6, 3)).astype(np.int64)
    weights = np.where(rng.random((6, 3)) < 0.6, 0.0, rng.uniform(0.1, 1.0, (6, 3))).astype(np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": td(targets), "weights": td(weights)},
    )
    out = training.forward_backward([datum], "cross_entropy").result()
    (lp,) = logprobs(out)
    assert lp.shape == (6, 3)
    columns = [
        types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": td(targets[:, k].copy()), "weights": td(weights[:, k].copy())},
        )
        for k in range(3)
    ]
    singles = logprobs(training.forward(columns, "cross_entropy").result())
    # Two fp32 computations (logits + log-sum-exp vs the fused cross-entropy) of the same logprobs.
    np.testing.assert_allclose(lp, np.stack(singles, axis=1), rtol=0, atol=1e-4)
    expected = -float((weights.astype(np.float64) * lp.astype(np.float64)).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-5)


# --- create_model waits for a free slot ---------------------------------------------------------
def test_more_creates_than_adapter_slots_all_complete(stack: Stack) -> None:
    """20 models on a 16-slot pool, none unloaded: every create completes (idle models are paged
    out to make room; waiting for a slot happens only while every slot has work in flight, which
    the planner's unit tests cover)."""
    client = service(stack, "filler")
    session_id = client.holder.get_session_id()
    raw = Raw(stack, "filler", "")
    for model_seq_id in range(1_000, 1_020):
        body = {
            "type": "create_model",
            "session_id": session_id,
            "model_seq_id": model_seq_id,
            "base_model": BASE,
            "lora_config": {"rank": 2},
        }
        created = raw.http.post("/api/v1/create_model", json=body)
        assert created.status_code == 200, created.text
        request_id = created.json()["request_id"]
        got: dict[str, object] = {"type": "try_again"}
        while got.get("type") == "try_again":  # each retrieve_future long-polls until the result
            got = raw.http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        assert got.get("type") == "create_model", got
