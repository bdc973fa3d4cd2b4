"""`python -m services.planner` (or `tinkerd serve planner`)."""

import os

from infra.runner import run_service
from services.planner.config import load_config
from services.planner.service import serve


def main() -> None:
    config = load_config(os.environ)
    run_service("planner", lambda stop: serve(config, stop))


if __name__ == "__main__":
    main()
