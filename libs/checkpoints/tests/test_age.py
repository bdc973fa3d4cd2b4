"""Encrypted exports: every file is encrypted to every recipient (any one identity decrypts it),
stored as `<name>.age`; a bad recipient list is refused naming the entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyrage
import pytest

from libs.checkpoints import age

_age: Any = pyrage


def test_every_file_is_encrypted_to_every_recipient(tmp_path: Path) -> None:
    source = tmp_path / "plain"
    source.mkdir()
    files = {"adapter_model.safetensors": bytes(range(256)) * 64, "adapter_config.json": b'{"r": 4}'}
    for name, data in files.items():
        (source / name).write_bytes(data)
    alice, bob = _age.x25519.Identity.generate(), _age.x25519.Identity.generate()
    target = age.encrypt_dir(source, tmp_path / "sealed", [str(alice.to_public()), str(bob.to_public())])
    assert sorted(p.name for p in target.iterdir()) == sorted(f"{name}.age" for name in files)
    for name, data in files.items():
        sealed = (target / f"{name}.age").read_bytes()
        assert data not in sealed
        assert _age.decrypt(sealed, [alice]) == data == _age.decrypt(sealed, [bob])


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (["age1nope"], "age_encryption_recipients[0]"),
        ([str(_age.x25519.Identity.generate().to_public()), "ssh-rsa AAAA"], "age_encryption_recipients[1]"),
        ([], "at least one"),
        (["age1x"] * 11, "at most 10"),
    ],
)
def test_bad_recipients_are_refused_naming_the_entry(values: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        age.parse_recipients(values)
