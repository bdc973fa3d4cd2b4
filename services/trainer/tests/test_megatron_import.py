"""The trainer imports megatron-core without compiling its fusion kernels (``parallel.import_megatron``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROBE = """
import sys, torch
compile_ = torch.compile
from services.trainer.parallel import import_megatron
import_megatron()
import megatron.core.jit as jit
print("torch._dynamo" in sys.modules, torch.compile is compile_, jit.jit_fuser(len) is len)
"""


def test_megatron_is_imported_with_its_fusions_plain_and_torch_compile_put_back() -> None:
    """In a fresh interpreter: after ``import_megatron`` TorchDynamo is not imported (megatron's
    forty ``jit_fuser`` decorators did not call ``torch.compile``), ``torch.compile`` is torch's own
    again, and ``jit_fuser`` returns a function unchanged."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["False", "True", "True"], done.stdout
