"""The `tinkerd` command: make-model, keys, events, status."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.harness import Stack

TINKERD = [sys.executable, "-m", "tinkerd.cli"]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_make_model_is_byte_for_byte_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        subprocess.run([*TINKERD, "make-model", "tiny", "--out", str(tmp_path / name)], check=True, capture_output=True)
    first, second = digests(tmp_path / "a"), digests(tmp_path / "b")
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(first)
    assert first == second


def test_keys_add_stores_only_a_hash(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    out = subprocess.run([*TINKERD, "keys", "add", "--tenant", "acme", "--file", str(keys)], check=True, capture_output=True, text=True)
    key = out.stdout.strip()
    assert key.startswith("tml-")
    stored = json.loads(keys.read_text())
    assert stored["keys"][0]["tenant"] == "acme"
    assert key not in keys.read_text()
    assert stored["keys"][0]["sha256"] == hashlib.sha256(key.encode()).hexdigest()


def test_events_command_prints_a_line_for_a_request(stack: Stack) -> None:
    """`tinkerd events --replay` shows the session a request created, as one readable line."""
    response = httpx.post(f"{stack.base_url}/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "tml-cli"})
    session_id = response.json()["session_id"]
    proc = subprocess.Popen([*TINKERD, "events", "--replay", "--nats", stack.nats_url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if session_id in line:
                assert line.split()[1] == "session"
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_status_command_summarises_the_stack(stack: Stack) -> None:
    out = subprocess.run([*TINKERD, "status", "--nats", stack.nats_url], check=True, capture_output=True, text=True, timeout=60)
    assert "trainers:" in out.stdout and "ready=True" in out.stdout
    assert "TINKER_REQUESTS" in out.stdout and "consumers" in out.stdout
