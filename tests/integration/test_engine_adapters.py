"""The gateway's engine pool against the real CPU sampler: adapters load on demand, stay bounded.

`services.gateway.sampling.engines.EnginePool` talks to the sampler's real HTTP app (the real engine, over
an in-process ASGI transport). What is checked is what a restarting or shared engine needs:

- an adapter the engine does not hold is loaded by the sample that needs it;
- at most `capacity` adapters stay loaded; the least recently used idle one is unloaded, and a
  sample of an unloaded snapshot loads it again and gets the same tokens;
- an engine that lost an adapter (a restart) answers "not loaded", and the pool loads it again;
- adapters under the data root that this pool did not load count against the limit and go first,
  while adapters from elsewhere (an operator's) are left alone;
- an engine that cannot be reached is reported as unavailable, not as a refused request;
- an address gets work only once it answered as a sampling engine of the pool's base model: a
  listener that does not speak HTTP, another HTTP server, or an engine of another model is
  unavailable, with what it was, and never receives an adapter or a `/generate`.

The pure parts (engine choice by rendezvous hashing, reading SGLang's "not loaded" answer and
its `loaded_adapters`) are checked on their own below.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from litestar import Litestar, get
from litestar.testing import AsyncTestClient

from bench.common import random_peft_adapter
from libs.models.tiny import build_tiny
from services.gateway.sampling import sglang
from services.gateway.sampling.engines import Adapter, EnginePool, rendezvous
from services.sampler.app import create_app
from services.sampler.config import SamplerConfig
from services.sampler.engine import HFEngine
from tests.netutil import unused_port

URL = "http://testserver.local"
GREEDY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", preset="tiny-qwen3")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data").resolve()


@pytest.fixture(scope="module")
def snapshots(model_dir: Path, data_root: Path) -> list[Adapter]:
    """Four sampler exports under the data root, each a different random PEFT LoRA."""
    out = []
    for i in range(4):
        directory = random_peft_adapter(model_dir, data_root / "samplers" / f"s{i}", seed=300 + i, rank=4)
        out.append(Adapter(name=f"run{i}.ephemeral.u{i}", directory=str(directory)))
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[HFEngine]:
    eng = HFEngine(SamplerConfig(model_path=str(model_dir)))
    yield eng
    eng.close()


@pytest.fixture
async def client(engine: HFEngine, model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(SamplerConfig(model_path=str(model_dir)), engine=engine)
    async with AsyncTestClient(app, base_url=URL) as test_client:
        yield test_client
        for name in list(engine.adapters()):  # every test starts with an empty engine
            await engine.unload_adapter(name)


async def held(client: httpx.AsyncClient) -> set[str]:
    """The adapters the engine serves (its `/server_info`, as SGLang's `loaded_lora_adapters`)."""
    response = await client.get(f"{URL}/server_info")
    return set(response.json()["loaded_lora_adapters"])


async def tokens(pool: EnginePool, adapter: Adapter | None) -> list[int]:
    outputs = await pool.generate(GREEDY, adapter)
    return outputs[0].output_ids


async def test_adapters_load_on_demand_and_at_most_capacity_stay_loaded(
    client: httpx.AsyncClient, snapshots: list[Adapter], data_root: Path
) -> None:
    """Each sample loads its snapshot; with capacity 2 the engine never holds more than two, and a
    snapshot that was unloaded is loaded again by its next sample, with the same greedy tokens."""
    pool = EnginePool(client, [URL], capacity=2, data_root=data_root)
    residency = pool.residency[URL]
    first: dict[str, list[int]] = {}
    for adapter in snapshots:
        first[adapter.name] = await tokens(pool, adapter)
        await residency.settled()
        loaded = await held(client)
        assert adapter.name in loaded
        assert len(loaded) <= 2, loaded
    assert residency.unloads == len(snapshots) - 2
    assert snapshots[0].name not in await held(client)
    assert await tokens(pool, snapshots[0]) == first[snapshots[0].name]
    assert len(set(map(tuple, first.values()))) > 1, "the adapters should change the samples"
    await pool.close()


async def test_an_engine_that_lost_an_adapter_is_given_it_again(
    client: httpx.AsyncClient, snapshots: list[Adapter], data_root: Path
) -> None:
    """The engine drops an adapter behind the pool's back (as a restart does): the next sample
    gets "not loaded" from `/generate`, loads it again and returns the same tokens."""
    pool = EnginePool(client, [URL], capacity=4, data_root=data_root)
    adapter = snapshots[1]
    before = await tokens(pool, adapter)
    loads = pool.residency[URL].loads
    await sglang.unload_adapter(client, URL, adapter.name)
    with pytest.raises(sglang.EngineError) as refused:
        await sglang.generate(client, URL, {**GREEDY, "lora_path": adapter.name})
    assert sglang.adapter_missing(refused.value)
    assert await tokens(pool, adapter) == before
    assert pool.residency[URL].loads == loads + 1
    await pool.close()


async def test_adapters_left_under_the_data_root_count_against_the_limit(
    client: httpx.AsyncClient, snapshots: list[Adapter], data_root: Path, model_dir: Path, tmp_path: Path
) -> None:
    """Adapters of the data root the pool did not load (another replica's, or one left by a gateway
    that restarted) are unloaded first once the limit is passed; an operator's adapter from
    outside the data root is never touched."""
    operator = random_peft_adapter(model_dir, tmp_path / "operator", seed=999, rank=4)
    await sglang.load_adapter(client, URL, "operator-adapter", str(operator))
    await sglang.load_adapter(client, URL, snapshots[2].name, str(snapshots[2].directory))
    pool = EnginePool(client, [URL], capacity=1, data_root=data_root)
    await tokens(pool, snapshots[3])
    await pool.residency[URL].settled()
    assert await held(client) == {"operator-adapter", snapshots[3].name}
    await pool.close()


async def test_an_unreachable_engine_is_unavailable_not_a_refusal(data_root: Path) -> None:
    """Nothing listens on the engine's port: `generate` raises `EngineUnavailable` (the sample
    waits for it), and waiting for it to come back times out while it stays away."""
    url = f"http://127.0.0.1:{unused_port()}"
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as http:
        pool = EnginePool(http, [url], capacity=2, data_root=data_root)
        with pytest.raises(sglang.EngineUnavailable) as down:
            await pool.generate(GREEDY, Adapter(name="x", directory=str(data_root / "x")))
        assert down.value.url == url
        assert not await pool.wait_available(0.5)
        await pool.close()


async def test_a_connection_reset_as_it_opens_is_unavailable_not_a_failure() -> None:
    """anyio's stream of a connection the engine reset as it opened (killed at that moment) has no
    socket, and httpcore's first look at it raises ``AttributeError`` from ``None.getpeername``
    (the transport below raises exactly that): a call is ``EngineUnavailable``, which the sample
    waits out, not an error that fails it."""

    def reset_as_it_opens(request: httpx.Request) -> httpx.Response:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    url = "http://127.0.0.1:9"
    async with httpx.AsyncClient(transport=httpx.MockTransport(reset_as_it_opens)) as http:
        with pytest.raises(sglang.EngineUnavailable, match="getpeername"):
            await sglang.generate(http, url, GREEDY)
        with pytest.raises(sglang.EngineUnavailable, match="getpeername"):
            await sglang.check_engine(http, url, ())


async def test_an_engine_of_the_pool_s_base_model_serves_and_one_of_another_gets_no_work(
    client: httpx.AsyncClient, snapshots: list[Adapter], data_root: Path, model_dir: Path
) -> None:
    """The CPU sampler reports its model directory in `/get_model_info`: a pool of that base
    model (named as the gateway names it) samples through it; a pool of another base model
    finds it unavailable, naming the model it serves, and loads nothing into it."""
    ours = EnginePool(client, [URL], capacity=2, data_root=data_root, model_names=("tiny-qwen3", str(model_dir)))
    assert await tokens(ours, None)
    await ours.close()
    other = EnginePool(client, [URL], capacity=2, data_root=data_root, model_names=("tiny-llama",))
    with pytest.raises(sglang.EngineUnavailable) as refused:
        await other.generate(GREEDY, snapshots[0])
    assert f"serves model {str(model_dir)!r}, not the base model 'tiny-llama'" in refused.value.reason
    assert other.residency[URL].loads == 0 and snapshots[0].name not in await held(client)
    assert other.engines[URL].failing_since is not None
    await other.close()


async def test_a_listener_that_does_not_speak_http_is_unavailable_not_an_engine(data_root: Path) -> None:
    """What a sample met when another process's listener (a gloo rendezvous, say) held the
    engine's port: the address accepts connections and closes them without an HTTP answer. The
    pool reports it unavailable, saying so, and waiting for it times out."""

    async def hang_up(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as http:
            pool = EnginePool(http, [f"http://127.0.0.1:{port}"], capacity=2, data_root=data_root)
            with pytest.raises(sglang.EngineUnavailable) as down:
                await pool.generate(GREEDY, None)
            assert down.value.reason.startswith("does not answer HTTP"), down.value.reason
            assert not await pool.wait_available(0.5)
            await pool.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_another_http_server_is_not_a_sampling_engine(data_root: Path) -> None:
    """An HTTP server whose `/health` answers 200 but that has no `/get_model_info` (not
    SGLang's API) is unavailable: "is not a sampling engine"."""

    @get("/health")
    async def health() -> str:
        return "ok"

    async with AsyncTestClient(Litestar([health]), base_url=URL) as other:
        pool = EnginePool(other, [URL], capacity=2, data_root=data_root)
        with pytest.raises(sglang.EngineUnavailable) as down:
            await pool.generate(GREEDY, None)
        assert down.value.reason == "is not a sampling engine (GET /get_model_info answered 404)"
        await pool.close()


def test_rendezvous_keeps_each_adapter_on_its_engine_unless_that_engine_is_gone() -> None:
    """Every key has one preferred engine; removing an engine moves only the keys it had."""
    engines = ["http://e0", "http://e1", "http://e2"]
    keys = [f"adapter-{i}" for i in range(300)]
    first = {key: rendezvous(engines, key)[0] for key in keys}
    assert first == {key: rendezvous(list(reversed(engines)), key)[0] for key in keys}
    assert set(first.values()) == set(engines), "keys should spread over every engine"
    survivors = [e for e in engines if e != "http://e1"]
    for key in keys:
        order = rendezvous(engines, key)
        assert sorted(order) == sorted(engines)
        moved = rendezvous(survivors, key)[0]
        assert moved == (first[key] if first[key] != "http://e1" else order[1])


def test_not_loaded_is_read_from_sglang_and_the_cpu_sampler_alike() -> None:
    """SGLang's 400 for an adapter it does not hold, in its older and newer wording, is "adapter
    missing" (the CPU sampler's own answer is checked against the real engine above); other
    refusals are not."""
    missing = [
        "The following requested LoRA adapters are not loaded: run.x.u1\nLoaded adapters: dict_keys([]).",
        "The following requested LoRA adapters are not loaded: {'run.x.u1'}\nLoaded adapters: set().",
    ]
    for message in missing:
        assert sglang.adapter_missing(sglang.EngineError(400, f'{{"error": {{"message": "{message}"}}}}'))
    assert not sglang.adapter_missing(sglang.EngineError(400, '{"error": {"message": "prompt too long"}}'))
    assert not sglang.adapter_missing(sglang.EngineError(500, "not loaded"))


def test_loaded_adapters_are_read_in_every_shape_engines_report_them() -> None:
    """`loaded_adapters` maps names to paths (the CPU sampler), or to SGLang's `LoRARef` as an
    object or in its array form; any other shape means "not reported", so nothing is reconciled."""
    as_paths = sglang.LoRAUpdate(success=True, loaded_adapters={"a": "/d/a", "b": "/d/b"})
    as_objects = sglang.LoRAUpdate(
        success=True, loaded_adapters={"a": {"lora_id": "1", "lora_name": "a", "lora_path": "/d/a"}}
    )
    as_arrays = sglang.LoRAUpdate(success=True, loaded_adapters={"a": ["1", "a", "/d/a", False]})
    assert sglang.reported_adapters(as_paths) == {"a": "/d/a", "b": "/d/b"}
    assert sglang.reported_adapters(as_objects) == {"a": "/d/a"}
    assert sglang.reported_adapters(as_arrays) == {"a": "/d/a"}
    assert sglang.reported_adapters(sglang.LoRAUpdate(success=True, loaded_adapters={"a": 3})) is None
    assert sglang.reported_adapters(sglang.LoRAUpdate(success=True)) is None
