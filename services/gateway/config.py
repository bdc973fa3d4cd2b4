"""Gateway settings (see `infra.config.from_env` for how variables map onto fields)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from infra.config import DEFAULT_DATA_DIR, DEFAULT_NATS_URL, MAX_LORA_RANK, from_env


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = DEFAULT_NATS_URL
    data_dir: str = DEFAULT_DATA_DIR
    base_model: str = "tiny-qwen3"
    """The deployment's primary base model (short name or directory): training and sampling."""
    extra_base_models: str = ""
    """More base models (comma-separated names), each trained by its own trainer group
    (`TINKERD_TRAINER_GROUPS`) and sampled through its own engines (`base_sampler_urls`)."""
    keys_file: str | None = None
    """JSON keys file; without one the gateway runs in open mode (loopback only)."""
    admin_key: str | None = None
    """Lets operator routes (status, metrics) be called from a non-loopback client."""
    sampler_url: str = "http://127.0.0.1:30000"
    """An SGLang-compatible engine (services/sampler on CPU, real SGLang on GPU). Any engine
    address may also be `file://PATH`: the file where a local engine announces the address it
    bound (`tinkerd up` gives the gateway its samplers this way; infra/net.py)."""
    sampler_urls: str = ""
    """Comma-separated engines to sample through (default: `sampler_url` alone); each adapter
    prefers one engine (rendezvous hashing) and moves to the next one while that is down.
    These engines serve the primary base model."""
    base_sampler_urls: str = ""
    """The engines of the extra base models: comma-separated `base=url` entries, a base repeated
    once per engine (`tiny-qwen3-narrow=http://127.0.0.1:30001`). An extra base without an entry
    trains but is not sampleable. Each engine serves one base model."""
    max_loaded_adapters: int = 16
    """Adapters kept on each engine; past that the least recently used idle one is unloaded."""
    sample_deadline_s: float = 1800.0
    """How long an accepted sample may wait for an unreachable engine before it fails."""
    engine_failing_s: float = 300.0
    """How long a sample waits once every engine of its base model has been failing (not
    started, not answering, or not a sampling engine of that model) for that long: then it fails,
    naming the engines and why, instead of waiting out `sample_deadline_s`."""
    public_url: str | None = None
    """How clients reach this gateway (for signed download URLs); defaults to http://host:port."""
    signing_secret: str | None = None
    """Secret for signed download URLs and JWTs. When unset, the first gateway replica stores a
    random one in KV `tinker_gateway` and every replica uses it (tokens and URLs work at any)."""
    jwt_auth: bool = False
    """Tell SDKs `pjwt_auth_enabled`: they exchange their key for a short-lived JWT
    (`POST /api/v1/auth/token`) and `RestClient.whoami` works. API keys keep working."""
    jwt_lifetime_s: float = 900.0
    client_transport: Literal["httpx", "pyqwest"] = "httpx"
    """The HTTP transport the client config tells SDKs to use (`use_pyqwest_transport`).
    `httpx`: pure Python. `pyqwest` (the SDK's own default): Rust threads that can still be
    calling into the interpreter while a finished client process exits; CPython up to 3.13 then
    aborts that process (SIGABRT, exit status 134 after the script's work is done) about one
    exit in fifty on a loaded machine (docs/operations.md, "The SDK's HTTP transport")."""
    cache_tokenizer: bool = True
    """For an embedded model (tiny-qwen3, tiny-llama): put its tokenizer in the local Hugging Face
    cache under its names, so `SamplingClient.get_tokenizer()` works on this machine."""

    max_lora_rank: int = MAX_LORA_RANK.default
    max_datums_per_request: int = 1024
    max_tokens_per_datum: int = 8192
    max_request_bytes: int = 5_000_000
    max_queue_depth_per_model: int = 256
    max_inflight_per_tenant: int = 2048
    sampling_capacity: int = 64
    """Concurrent sub-generations (num_samples summed) admitted across all tenants."""
    max_num_samples: int = 64
    result_retention_s: float = 3600.0
    """How long results are kept (the results stream's max age); older futures answer 410."""
    retrieve_wait_s: float = 30.0
    """How long retrieve_future holds a pending request before answering try_again."""
    max_live_models_per_tenant: int = 256
    """Models not unloaded per tenant (accounts/quotas.py); 0: no limit."""
    max_stored_bytes_per_tenant: int = 100 << 30
    """Bytes of catalogued checkpoints per tenant before named saves are refused; 0: no limit."""
    session_expiry_s: float = 300.0
    """A session with no heartbeat for this long is expired: its models are unloaded (the SDK
    beats every 10 s). Its futures still answer and its checkpoints stay."""
    session_reap_interval_s: float = 30.0
    """How often each gateway looks for lapsed sessions."""
    stable_reinforce: Literal["serve", "refuse"] = "serve"
    """`serve`: `loss_fn="stable_reinforce"` runs Tinkerd's own objective (docs/semantics.md);
    `refuse`: it is a 400 (the hosted objective is unpublished)."""

    def engines(self) -> list[str]:
        urls = [u.strip().rstrip("/") for u in self.sampler_urls.split(",") if u.strip()]
        return urls or [self.sampler_url.rstrip("/")]

    def base_engines(self) -> dict[str, list[str]]:
        """`base_sampler_urls` as {base name as written: [engine URL, ...]} (in the order given).

        Raises:
            ValueError: an entry is not `base=url`.
        """
        out: dict[str, list[str]] = {}
        for entry in (e.strip() for e in self.base_sampler_urls.split(",")):
            if not entry:
                continue
            base, sep, url = (part.strip() for part in entry.partition("="))
            if not sep or not base or not url:
                raise ValueError(
                    f"TINKERD_GATEWAY_BASE_SAMPLER_URLS: {entry!r} is not base=url "
                    "(e.g. tiny-qwen3-narrow=http://127.0.0.1:30001)"
                )
            out.setdefault(base, []).append(url.rstrip("/"))
        return out


def load_config(env: Mapping[str, str], **overrides: object) -> GatewayConfig:
    return from_env(GatewayConfig, "gateway", env, **overrides)
