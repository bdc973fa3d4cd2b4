"""Static checks of the compose stack: infra/docker-compose.yml, infra/Dockerfile, the env example.

Nothing here runs Docker. The files are parsed and held against the code they configure, so a
renamed service, config field, console script or mount path fails here rather than in a
deployment. The compose file reads `infra/tinkerd.env`, which is not in the repository: operators
create it with `cp infra/tinkerd.env.example infra/tinkerd.env` (docs/operations.md), so every
env_file must exist or have a `.example` beside it.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec
import pytest
import yaml

from services.gateway.accounts.auth import check_bind
from services.gateway.config import GatewayConfig
from services.gateway.config import load_config as gateway_config
from services.planner.config import PlannerConfig
from services.planner.config import load_config as planner_config
from services.publisher.config import PublisherConfig
from services.publisher.config import load_config as publisher_config
from services.sampler.config import SamplerConfig
from services.trainer.config import TrainerConfig
from services.trainer.config import load_config as trainer_config
from tinkerd.supervisor import SERVICES

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker-compose.yml"
CLUSTER = INFRA / "docker-compose.cluster.yml"
"""The clustered variant, laid over COMPOSE (`-f docker-compose.yml -f docker-compose.cluster.yml`)."""
DOCKERFILE = INFRA / "Dockerfile"
ENV_EXAMPLE = INFRA / "tinkerd.env.example"
OPERATIONS = ROOT / "docs" / "operations.md"

DATA_VOLUME = "tinkerd-data"
"""The named volume holding checkpoints, sampler exports, staging and base models."""
SHARE_CHECKPOINTS = ("gateway", "trainer", "publisher", "sglang")
GPU_SERVICES = ("trainer", "sglang")
TINKERD_SERVICES = ("gateway", "planner", "trainer", "publisher")
"""The Tinkerd services a GPU stack runs (SGLang stands in for the CPU sampler)."""

CONFIGS: dict[str, type[msgspec.Struct]] = {
    "gateway": GatewayConfig,
    "planner": PlannerConfig,
    "trainer": TrainerConfig,
    "publisher": PublisherConfig,
    "sampler": SamplerConfig,
}
PROCESS_WIDE_SOURCES = (ROOT / "infra" / "runner.py", ROOT / "infra" / "tracing.py", ROOT / "infra" / "streams.py")
"""Where variables that are not config fields are read (logging, tracing)."""

VARIABLE = re.compile(r"\bTINKERD_[A-Z0-9_]*[A-Z0-9]")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict), "docker-compose.yml must be a mapping"
    return loaded


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = compose.get("services")
    assert isinstance(found, dict) and found, "docker-compose.yml declares no services"
    return found


def env_assignments(path: Path) -> dict[str, str]:
    """The uncommented KEY=VALUE lines of an env file."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


def runs_tinkerd(service: Mapping[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("tinkerd")


def command_words(service: Mapping[str, Any]) -> list[str]:
    """The service's command as words, with a `sh -c` script split into its own words too."""
    command = service.get("command", [])
    words = [command] if isinstance(command, str) else [str(word) for word in command]
    return [part for word in words for part in shlex.split(word)]


def mount_target(service: Mapping[str, Any], volume: str) -> str | None:
    """Where `service` mounts the named `volume` (short or long volume syntax), or None."""
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            source, _, rest = entry.partition(":")
            if source == volume:
                return rest.split(":")[0]
        elif isinstance(entry, dict) and entry.get("source") == volume:
            return str(entry["target"])
    return None


def known_variables() -> set[str]:
    """Every TINKERD_* name some service reads: config fields in both forms, plus process-wide ones."""
    names: set[str] = set()
    for service, config in CONFIGS.items():
        for field in config.__struct_fields__:
            names.add(f"TINKERD_{service.upper()}_{field.upper()}")
            names.add(f"TINKERD_{field.upper()}")
    for source in PROCESS_WIDE_SOURCES:
        names |= set(re.findall(r"environ\.get\(\s*\"(TINKERD_[A-Z0-9_]+)\"", source.read_text()))
    return names


def test_the_stack_has_the_bus_the_services_and_sglang(services: dict[str, dict[str, Any]]) -> None:
    assert {"nats", *TINKERD_SERVICES, "sglang"} <= set(services)


def test_tinkerd_services_serve_a_real_service_module(services: dict[str, dict[str, Any]]) -> None:
    served = set()
    for name, service in services.items():
        if not runs_tinkerd(service):
            continue
        command = service.get("command")
        assert isinstance(command, list) and len(command) == 2 and command[0] == "serve", (
            f"{name}: command must be [serve, SERVICE] (the image's entrypoint is `tinkerd`), got {command!r}"
        )
        module = command[1]
        assert module in SERVICES, f"{name}: `tinkerd serve {module}` is not a service ({SERVICES})"
        assert (ROOT / "services" / module / "__main__.py").is_file(), (
            f"{name}: services/{module}/__main__.py"
        )
        served.add(module)
    assert set(TINKERD_SERVICES) <= served, f"not run by compose: {set(TINKERD_SERVICES) - served}"


def test_build_contexts_and_dockerfiles_exist(services: dict[str, dict[str, Any]]) -> None:
    builds = {name: s["build"] for name, s in services.items() if "build" in s}
    assert builds, "no service builds the Tinkerd image"
    for name, build in builds.items():
        context_rel = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        context = (COMPOSE.parent / context_rel).resolve()
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        assert context == ROOT, f"{name}: the build context must be the repository root, got {context}"
        assert (context / dockerfile).is_file(), f"{name}: {context / dockerfile} does not exist"


def test_env_files_exist_or_have_an_example_and_the_copy_step_is_documented(
    services: dict[str, dict[str, Any]],
) -> None:
    env_files = set()
    for service in services.values():
        entries = service.get("env_file", [])
        for entry in [entries] if isinstance(entries, str) else entries:
            env_files.add(entry if isinstance(entry, str) else entry["path"])
    assert env_files, "no service reads an env file"
    for env_file in env_files:
        path = COMPOSE.parent / env_file
        example = path.with_name(path.name + ".example")
        assert path.is_file() or example.is_file(), f"{env_file}: neither it nor {example.name} exists"
        if not path.is_file():
            step = f"cp infra/{example.name} infra/{path.name}"
            assert step in COMPOSE.read_text(), f"docker-compose.yml must show `{step}`"
            assert step in OPERATIONS.read_text(), f"docs/operations.md must show `{step}`"


@pytest.mark.parametrize("name", GPU_SERVICES)
def test_gpu_services_reserve_a_gpu(services: dict[str, dict[str, Any]], name: str) -> None:
    devices = services[name].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    assert any("gpu" in device.get("capabilities", []) for device in devices), (
        f"{name}: needs deploy.resources.reservations.devices with capabilities: [gpu]"
    )


def test_the_checkpoint_volume_is_mounted_at_the_data_dir_everywhere(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    assert DATA_VOLUME in (compose.get("volumes") or {}), f"volume {DATA_VOLUME} is not declared"
    targets = {name: mount_target(services[name], DATA_VOLUME) for name in SHARE_CHECKPOINTS}
    assert None not in targets.values(), f"{DATA_VOLUME} is not mounted in: {targets}"
    assert len(set(targets.values())) == 1, f"{DATA_VOLUME} must be mounted at one path: {targets}"
    data_dir = env_assignments(ENV_EXAMPLE).get("TINKERD_DATA_DIR")
    assert data_dir == next(iter(targets.values())), (
        "TINKERD_DATA_DIR must be the volume's mount path: staging and checkpoint paths are absolute"
    )


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for entry in service.get("volumes", []):
            source = entry.partition(":")[0] if isinstance(entry, str) else str(entry.get("source", ""))
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source} is not declared at the top level"
            elif source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: bind mount {source} does not exist"


def test_env_example_names_only_real_settings() -> None:
    known = known_variables()
    assert {"TINKERD_TRACE_EXPORTER", "TINKERD_LOG_LEVEL"} <= known, "process-wide variables moved"
    mentioned = set(VARIABLE.findall(ENV_EXAMPLE.read_text()))
    unknown = sorted(mentioned - known)
    assert not unknown, f"tinkerd.env.example names variables no service reads: {unknown}"


def test_env_example_configures_a_consistent_stack(services: dict[str, dict[str, Any]]) -> None:
    env = env_assignments(ENV_EXAMPLE)
    gateway = gateway_config(env)
    planner = planner_config(env)
    trainer = trainer_config(env)
    publisher = publisher_config(env)
    check_bind(gateway.host, Path(gateway.keys_file) if gateway.keys_file else None)
    assert planner.trainer_group == trainer.group, "the planner must send units to the trainer's group"
    assert planner.num_slots == trainer.num_slots, "planner and trainer must agree on adapter slots"
    for url in (planner.nats_url, trainer.nats_url, publisher.nats_url, gateway.nats_url):
        assert urlparse(url).hostname in services, f"{url}: not a compose service"
    for url in gateway.engines():
        parsed = urlparse(url)
        assert parsed.hostname == "sglang", f"{url}: the compose sampler is the sglang service"
        assert f"--port {parsed.port}" in " ".join(command_words(services["sglang"]))
    assert trainer.data_dir == gateway.data_dir == publisher.data_dir
    assert trainer.device == "cuda"


def test_sglang_serves_lora_with_raw_logprobs(services: dict[str, dict[str, Any]]) -> None:
    sglang = services["sglang"]
    assert str(sglang.get("image", "")).startswith("lmsysorg/sglang")
    command = " ".join(command_words(sglang))
    for flag in (
        "sglang.launch_server",
        "--model-path",
        "--enable-lora",
        "--max-loras-per-batch",
        "--lora-target-modules all",
        "--host 0.0.0.0",
        "--port 30000",
    ):
        assert flag in command, f"sglang: missing {flag!r} in {command!r}"
    environment = sglang.get("environment", {})
    assert str(environment.get("SGLANG_RETURN_ORIGINAL_LOGPROB")) == "1"
    rank = re.search(r"--max-lora-rank (\d+)", command)
    assert rank is not None, "sglang: --max-lora-rank is required for dynamically loaded adapters"
    gateway = gateway_config(env_assignments(ENV_EXAMPLE))
    assert int(rank.group(1)) >= gateway.max_lora_rank, "SGLang must load every rank the gateway accepts"


def test_nats_runs_jetstream_on_a_volume_with_room_for_requests(services: dict[str, dict[str, Any]]) -> None:
    nats = services["nats"]
    assert str(nats.get("image", "")).startswith("nats:")
    command = [str(word) for word in nats.get("command", [])]
    assert "-js" in command and "-m" in command
    store = command[command.index("-sd") + 1]
    assert any(isinstance(v, str) and v.split(":")[1] == store for v in nats.get("volumes", [])), (
        f"nats: the JetStream store {store} must be on a volume"
    )
    config = command[command.index("-c") + 1]
    host_config = next(v.split(":")[0] for v in nats["volumes"] if v.split(":")[1] == config)
    text = (COMPOSE.parent / host_config).read_text()
    match = re.search(r"^max_payload:\s*(\d+)\s*MB", text, re.MULTILINE)
    assert match, "nats.conf must raise max_payload"
    gateway = gateway_config(env_assignments(ENV_EXAMPLE))
    assert int(match.group(1)) * 1024 * 1024 > gateway.max_request_bytes, (
        "a forward_backward command up to max_request_bytes must fit in one NATS message"
    )


def test_dockerfile_entrypoint_is_the_tinkerd_console_script() -> None:
    text = DOCKERFILE.read_text()
    entrypoints = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert len(entrypoints) == 1, "the Dockerfile needs one exec-form ENTRYPOINT"
    entrypoint = json.loads(entrypoints[0])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert entrypoint == ["tinkerd"], f"ENTRYPOINT must be the tinkerd console script, got {entrypoint}"
    assert project["scripts"]["tinkerd"] == "tinkerd.cli:main"
    assert "gpu" in project["optional-dependencies"], "the image installs the `gpu` extra"
    assert '".[gpu]"' in text, "the image installs the project with its `gpu` extra"
    data_dir = env_assignments(ENV_EXAMPLE)["TINKERD_DATA_DIR"]
    assert f"TINKERD_DATA_DIR={data_dir}" in text, "the image's default data dir must match the compose mount"


def test_the_cluster_variant_runs_three_routed_jetstream_nodes_and_points_every_service_at_them(
    services: dict[str, dict[str, Any]],
) -> None:
    """docker-compose.cluster.yml: `nats`, `nats-2` and `nats-3` are JetStream servers of one
    cluster, each with its own name, its own store volume and routes to the other two; every
    Tinkerd service lists all three client URLs and asks for 3 replicas; and the names it
    overrides exist in the base file."""
    overlay = yaml.safe_load(CLUSTER.read_text())
    nodes = {"nats": "n1", "nats-2": "n2", "nats-3": "n3"}
    merged = {name: {**services.get(name, {}), **overlay["services"][name]} for name in nodes}
    for name, server_name in nodes.items():
        words = [str(w) for w in merged[name]["command"]]
        flags = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
        assert "-js" in words and flags.get("--server_name") == server_name, name
        assert flags.get("--cluster_name") == "tinkerd" and flags.get("--cluster") == "nats://0.0.0.0:6222", name
        routes = {urlparse(r).hostname for r in flags["--routes"].split(",")}
        assert routes == set(nodes) - {name}, f"{name} must route to the two other nodes"
        stores = [v for v in merged[name]["volumes"] if v.endswith(":/data")]
        assert len(stores) == 1, name
    store_volumes = {next(v for v in merged[n]["volumes"] if v.endswith(":/data")) for n in nodes}
    assert len(store_volumes) == 3, "each node needs its own store volume"
    for name in TINKERD_SERVICES:
        assert name in services, f"the overlay overrides {name}, which the base file lacks"
        env = overlay["services"][name]["environment"]
        hosts = {urlparse(u).hostname for u in env["TINKERD_NATS_URL"].split(",")}
        assert hosts == set(nodes), name
        assert env["TINKERD_NATS_REPLICAS"] == "3", name
    declared = set(overlay.get("volumes", {})) | {"nats-data"}
    assert {v.split(":")[0] for v in store_volumes} <= declared
