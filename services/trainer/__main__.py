"""`python -m services.trainer` (or `tinkerd serve trainer`)."""

import os

from infra.runner import run_service
from services.trainer.config import load_config
from services.trainer.service import serve


def main() -> None:
    config = load_config(os.environ)
    run_service("trainer", lambda stop: serve(config, stop))


if __name__ == "__main__":
    main()
