"""Signed download URLs (``downloads.verify``) never reach outside the data root."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.gateway.catalog import downloads
from services.gateway.http.errors import Forbidden


def test_signed_paths_outside_the_data_root_are_refused(tmp_path: Path) -> None:
    root, secret, later = tmp_path / "data", b"k", str(int(time.time()) + 60)
    root.mkdir()
    (tmp_path / "outside").write_text("secret")
    (root / "link").symlink_to(tmp_path / "outside")
    for relative in ("../outside", "link", "/etc/passwd"):
        with pytest.raises(Forbidden):
            downloads.verify(secret, root, relative, later, downloads.signature(secret, relative, int(later)))
