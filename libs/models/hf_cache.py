"""Make an embedded base model's tokenizer loadable by name from the local Hugging Face cache.

The SDK's `SamplingClient.get_tokenizer()` calls `AutoTokenizer.from_pretrained(<base model name>)`.
For a model that exists only on this machine (the tiny presets), that name resolves through the
Hub cache: this writes the tokenizer files (and config.json, which AutoTokenizer reads to pick the
class) as a snapshot `models--<org>--<name>/snapshots/<content hash>` with `refs/main` pointing at
it, under every name a client may hold (`tiny-qwen3` and `tinkerd/tiny-qwen3`). No weights are
copied. Offline (`HF_HUB_OFFLINE=1`) the cache is read directly; online, a name the Hub does not
know falls back to the cached snapshot.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def hub_cache() -> Path:
    """Where huggingface_hub looks (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE).expanduser()
    except ImportError:
        pass
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def install_tokenizer(model_dir: Path, repo_ids: list[str], cache: Path | None = None) -> list[Path]:
    """Cache `model_dir`'s tokenizer under each of `repo_ids`; returns the snapshot directories.

    Idempotent: the snapshot is named by a hash of the files, written under a temporary name and
    renamed into place; `refs/main` is replaced atomically.
    """
    cache = cache or hub_cache()
    files = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    revision = digest.hexdigest()
    snapshots = []
    for repo_id in repo_ids:
        root = repo_dir(cache, repo_id)
        snapshot = root / "snapshots" / revision
        if not snapshot.is_dir():
            tmp = snapshot.with_name(f".tmp-{revision}-{uuid.uuid4().hex[:8]}")
            tmp.mkdir(parents=True)
            for path in files:
                shutil.copyfile(path, tmp / path.name)
            try:
                os.rename(tmp, snapshot)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another process installed it first
        ref = root / "refs" / "main"
        ref.parent.mkdir(parents=True, exist_ok=True)
        if not ref.is_file() or ref.read_text() != revision:
            tmp_ref = ref.with_name(f".main-{uuid.uuid4().hex[:8]}")
            tmp_ref.write_text(revision)
            tmp_ref.replace(ref)
        snapshots.append(snapshot)
    return snapshots
