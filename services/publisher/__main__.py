"""`python -m services.publisher` (or `tinkerd serve publisher`)."""

import os

from infra.runner import run_service
from services.publisher.config import load_config
from services.publisher.service import serve


def main() -> None:
    config = load_config(os.environ)
    run_service("publisher", lambda stop: serve(config, stop))


if __name__ == "__main__":
    main()
