"""Time-limited, HMAC-signed download URLs for checkpoint files, served by the gateway itself.

A URL names a path relative to the data root plus an expiry, and carries
`sig = HMAC-SHA256(secret, "<relative path>\\n<expires>")`. The download route needs no API key:
the signature is the authorisation. It refuses a bad or expired signature (403) and any path that
resolves outside the data root. A signed directory is streamed as an uncompressed tar (the
`archive` form older CLIs download and extract).
"""

from __future__ import annotations

import hashlib
import hmac
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from services.gateway.catalog.catalog import within
from services.gateway.http.errors import Forbidden, NotFound

CHUNK = 1 << 20
BLOCK = 512


def signature(secret: bytes, relative: str, expires: int) -> str:
    return hmac.new(secret, f"{relative}\n{expires}".encode(), hashlib.sha256).hexdigest()


def signed_url(base_url: str, secret: bytes, relative: str, expires: int) -> str:
    sig = signature(secret, relative, expires)
    return f"{base_url.rstrip('/')}/api/v1/downloads/{quote(relative)}?expires={expires}&sig={sig}"


def files_of(directory: Path) -> list[Path]:
    """Regular files under `directory` (recursively), in a stable order; links are not followed."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def sign_files(base_url: str, secret: bytes, data_dir: Path, directory: Path, expires: int) -> dict[str, str]:
    """`{path relative to the checkpoint: signed URL}` for every file of a checkpoint directory."""
    return {
        str(f.relative_to(directory)): signed_url(base_url, secret, str(f.relative_to(data_dir)), expires)
        for f in files_of(directory)
    }


def verify(secret: bytes, data_dir: Path, relative: str, expires: str | None, sig: str | None) -> Path:
    """The file or directory a signed URL names; Forbidden/NotFound when it may not be served."""
    if not expires or not sig or not expires.isdigit():
        raise Forbidden("download URL is not signed (expires and sig are required)")
    if not hmac.compare_digest(signature(secret, relative, int(expires)), sig):
        raise Forbidden("download URL signature is invalid")
    if int(expires) < time.time():
        raise Forbidden("download URL has expired; ask for a new one")
    target = data_dir / relative
    if ".." in Path(relative).parts or not within(data_dir, target):
        raise Forbidden("download path is outside the data root")
    if not target.exists():
        raise NotFound("the checkpoint behind this download URL no longer exists")
    return target


def tar_size(directory: Path) -> int:
    body = sum(BLOCK + -(-f.stat().st_size // BLOCK) * BLOCK for f in files_of(directory))
    return body + 2 * BLOCK


def tar_stream(directory: Path) -> Iterator[bytes]:
    """A ustar archive of `directory`, produced file by file in bounded chunks."""
    for path in files_of(directory):
        info = tarfile.TarInfo(str(path.relative_to(directory)))
        info.size, info.mode, info.mtime = path.stat().st_size, 0o644, int(path.stat().st_mtime)
        yield info.tobuf(format=tarfile.USTAR_FORMAT)
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                yield chunk
        if info.size % BLOCK:
            yield b"\0" * (BLOCK - info.size % BLOCK)
    yield b"\0" * (2 * BLOCK)
