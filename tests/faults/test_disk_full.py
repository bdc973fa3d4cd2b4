"""A full disk during a checkpoint write: a clear error, the previous checkpoint intact, nothing
half-published, and the next save works once there is space again.

The disk fills at an exact place (`libs/faults.py`, action `enospc`), as a full disk does: once in
the trainer, whose write of the hand-off copy fails after half of a file was written, and once in
the publisher, whose placing of the version's second file (a hard link of the staged one) fails,
each on a later save of the same name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.harness import Stack
from tests.sdk import checkpoint_digests, tenant_datum

# save 1 writes hits 1-3 in each (adapter, optimizer, state.json); save 2 fails at the trainer's
# 4th write (its first file); save 3 passes the trainer (writes 5-7) and fails at the publisher's
# 5th (its second file); save 4 succeeds.
POINTS = ("trainer.checkpoint_write@4:enospc", "publisher.checkpoint_write@5:enospc")


def test_a_full_disk_during_a_checkpoint_write(tmp_path: Path) -> None:
    env = {"TINKERD_FAULT_POINTS": ",".join(POINTS), "TINKERD_FAULT_DIR": str(tmp_path / "faults")}
    stack = Stack(tmp_path / "stack", env_overrides=env).start()
    try:
        with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-disk-full") as client:
            trainer = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7)

            def step(n: int) -> None:
                trainer.forward_backward([tenant_datum(9, n, 0)], "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()

            step(0)
            first = trainer.save_state("ckpt").result().path
            saved = checkpoint_digests(stack.data_dir, first)
            step(1)
            for where in ("trainer", "publisher"):
                with pytest.raises(tinker.RequestFailedError) as failed:
                    trainer.save_state("ckpt").result()
                message = str(failed.value)
                assert "No space left on device" in message, (where, message)
                assert f"{first} still holds its previous version" in message, (where, message)
                assert "Free disk space on the server, then save again" in message, (where, message)
                assert checkpoint_digests(stack.data_dir, first) == saved, f"{where}: the previous checkpoint changed"
                leftovers = [p for p in (stack.data_dir / "checkpoints").rglob("*") if p.name.startswith((".tmp-", ".link-"))]
                assert not leftovers, f"{where}: half-written files left behind: {leftovers}"
                assert not any((stack.data_dir / "staging").iterdir()), f"{where}: a staging copy was left behind"
                listed = [c for c in client.create_rest_client().list_checkpoints(trainer.model_id).result().checkpoints if c.checkpoint_type == "training"]
                assert [c.tinker_path for c in listed] == [first], f"{where}: the catalogue changed"

            again = trainer.save_state("ckpt").result().path
            assert again == first
            after = checkpoint_digests(stack.data_dir, again)
            assert after["step"] == "2" and after != saved
    finally:
        stack.stop()


pytestmark = pytest.mark.slow
