"""Encrypted exports in the age format (filippo.io/age), through the `pyrage` binding.

`save_weights_external(..., age_encryption_recipients=[...])` names at most `MAX_RECIPIENTS`
recipients, each a native X25519 key (`age1...`) or an SSH public key (`ssh-ed25519 ...`,
`ssh-rsa ...`). Every file of the export is encrypted to all of them and stored under its name
plus `SUFFIX`; any one recipient's identity decrypts it (`age -d -i KEY`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyrage

SUFFIX = ".age"
MAX_RECIPIENTS = 10
FIELD = "age_encryption_recipients"

_age: Any = pyrage  # the extension module ships no type information


def parse_recipients(values: Sequence[str]) -> list[Any]:
    """The recipients `values` name, or ValueError naming the first bad entry and why."""
    if not values:
        raise ValueError(f"{FIELD} must name at least one recipient (or be omitted for a plain export)")
    if len(values) > MAX_RECIPIENTS:
        raise ValueError(f"{FIELD} names {len(values)} recipients; at most {MAX_RECIPIENTS} are allowed")
    parsed = []
    for i, value in enumerate(values):
        text = value.strip() if isinstance(value, str) else ""
        kind = _age.x25519 if text.startswith("age1") else _age.ssh
        try:
            parsed.append(kind.Recipient.from_str(text))
        except (_age.RecipientError, ValueError) as exc:
            raise ValueError(
                f"{FIELD}[{i}] is not an age recipient (an age1... key or an SSH public key): {exc}"
            ) from exc
    return parsed


def encrypt_dir(source: Path, target: Path, recipients: Sequence[str]) -> Path:
    """Encrypt every file of `source` to `recipients` into `target` (created afresh), each as
    `<name>.age`; returns `target`."""
    keys = parse_recipients(recipients)
    target.mkdir(parents=True, exist_ok=False)
    for src in sorted(source.iterdir()):
        if src.is_file():
            _age.encrypt_file(str(src), str(target / f"{src.name}{SUFFIX}"), keys)
    return target
