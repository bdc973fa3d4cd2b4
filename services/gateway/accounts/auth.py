"""Who is calling: API keys (`X-API-Key`) mapped to tenants.

Two modes:
- keys file: a JSON file `{"keys": [{"tenant": "...", "sha256": "<hex of the key>"}]}` (keys are
  stored only hashed; `tinkerd keys add` appends one). Unknown keys get 401.
- open mode, allowed only on loopback binds: every `tml-` key is its own tenant, identified by a
  digest of the key (the embedded default for a laptop).
A non-loopback bind without a keys file refuses to start (see `check_bind`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
from pathlib import Path

import msgspec

from services.gateway.http.errors import Unauthorized


class KeyEntry(msgspec.Struct):
    tenant: str
    sha256: str
    name: str = ""


class KeysFile(msgspec.Struct):
    keys: list[KeyEntry] = []


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class Tenant(msgspec.Struct, frozen=True):
    id: str
    key_digest: str
    key_name: str = ""


class KeyRing:
    """Resolves an API key to a tenant, or raises Unauthorized."""

    def __init__(self, keys_file: Path | None) -> None:
        self.keys_file = keys_file
        self._by_digest: dict[str, KeyEntry] = {}
        if keys_file is not None:
            parsed = msgspec.json.decode(keys_file.read_bytes(), type=KeysFile)
            self._by_digest = {entry.sha256: entry for entry in parsed.keys}

    @property
    def open_mode(self) -> bool:
        return self.keys_file is None

    def authenticate(self, api_key: str | None) -> Tenant:
        if not api_key:
            raise Unauthorized("missing X-API-Key header")
        key_digest = digest(api_key)
        if self.open_mode:
            if not api_key.startswith("tml-"):
                raise Unauthorized("API keys start with 'tml-'")
            return Tenant(id=f"t-{key_digest[:16]}", key_digest=key_digest)
        for known, entry in self._by_digest.items():
            if hmac.compare_digest(known, key_digest):
                return Tenant(id=entry.tenant, key_digest=key_digest, key_name=entry.name)
        raise Unauthorized("unknown API key")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys_file: Path | None) -> None:
    """Refuse to serve a non-loopback address in open mode."""
    if keys_file is None and not is_loopback(host):
        raise SystemExit(
            f"refusing to bind {host} without a keys file: open mode is for loopback only "
            "(create one with `tinkerd keys add --tenant NAME --file keys.json`)"
        )


def add_key(keys_file: Path, tenant: str, name: str = "") -> str:
    """Mint a new `tml-` key for `tenant`, store its hash in `keys_file`, and return the key."""
    key = "tml-" + secrets.token_urlsafe(32)
    current = KeysFile()
    if keys_file.exists():
        current = msgspec.json.decode(keys_file.read_bytes(), type=KeysFile)
    current.keys.append(KeyEntry(tenant=tenant, sha256=digest(key), name=name))
    keys_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = keys_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(msgspec.to_builtins(current), indent=2))
    tmp.chmod(0o600)
    tmp.replace(keys_file)
    return key
