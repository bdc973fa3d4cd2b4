"""Info and health routes in SGLang's shapes."""

from __future__ import annotations

from pathlib import Path

from litestar.testing import TestClient


def test_server_info_reports_limits_and_adapters(client: TestClient, model_dir: Path) -> None:
    """/server_info and /get_server_info carry the model, context and LoRA limits."""
    info = client.get("/server_info").json()
    assert client.get("/get_server_info").json().keys() == info.keys()
    assert info["model_path"] == str(model_dir)
    assert info["context_length"] == 2048 and info["max_req_input_len"] + 6 == 2048
    assert (
        info["max_lora_rank"] == 64 and info["max_loaded_loras"] == 16 and info["max_running_requests"] == 16
    )
    assert {"q_proj", "down_proj", "lm_head"} <= set(info["lora_target_modules"])
    assert {"ad0", "head"} <= set(info["loaded_lora_adapters"])
    assert info["internal_states"][0]["decode_steps"] >= 0


def test_model_info_and_health(client: TestClient, model_dir: Path) -> None:
    """/get_model_info says it generates; /health and /health_generate answer 200."""
    assert client.get("/get_model_info").json() == {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "is_generation": True,
    }
    assert client.get("/model_info").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
