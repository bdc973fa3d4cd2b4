"""`python -m services.trainer` (or `tinkerd serve trainer [--tp N]`).

With ``TINKERD_TRAINER_TP`` > 1 and no ``RANK`` set, this process is the launcher of one TP
group (services/trainer/group.py); with ``RANK`` set it is one rank of a group.
"""

import os
import sys
from pathlib import Path

from infra.runner import run_service, setup_logging
from services.trainer import group
from services.trainer.config import load_config


def main() -> None:
    config = load_config(os.environ)
    if config.tp < 1:
        raise SystemExit(f"invalid trainer configuration: tp must be >= 1, got {config.tp} (TINKERD_TRAINER_TP)")
    ranked = group.rank_env(os.environ)
    if ranked is None and config.tp > 1:
        from libs.models.registry import resolve_base_model

        setup_logging()
        resolve_base_model(config.base_model, Path(config.data_dir).expanduser().resolve())  # once, not per rank
        sys.exit(group.launch(config.tp))
    from services.trainer.service import follow_rank, serve  # torch and megatron: ranks only

    if ranked is not None and ranked[0] > 0:
        setup_logging()
        follow_rank(config)
        return
    run_service("trainer", lambda stop: serve(config, stop))


if __name__ == "__main__":
    main()
