"""The `tinkerd` command: up, serve, events, status, make-model, keys."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from pathlib import Path

from infra.config import DEFAULT_DATA_DIR, DEFAULT_NATS_URL
from libs.checkpoints import layout


def _nats_url(args: argparse.Namespace) -> str:
    """--nats, else TINKERD_NATS_URL, else the server `tinkerd up` started for this data dir."""
    if args.nats or os.environ.get("TINKERD_NATS_URL"):
        return str(args.nats or os.environ["TINKERD_NATS_URL"])
    written = layout.nats_url_file(Path(os.environ.get("TINKERD_DATA_DIR", DEFAULT_DATA_DIR)))
    return written.read_text().strip() if written.exists() else DEFAULT_NATS_URL


def cmd_up(args: argparse.Namespace) -> int:
    from tinkerd.supervisor import SERVICES, up

    services = tuple(args.services.split(",")) if args.services else SERVICES
    unknown = set(services) - set(SERVICES)
    if unknown:
        raise SystemExit(f"unknown services {sorted(unknown)}; choose from {SERVICES}")
    if args.gateways < 1:
        raise SystemExit(f"--gateways must be at least 1, got {args.gateways}")
    return up(
        data_dir=Path(args.data_dir).expanduser().resolve(),
        host=args.host,
        port=args.port,
        base_model=args.base_model,
        nats_url=args.nats,
        services=services,
        gateways=args.gateways,
        extra_env={"TINKERD_TRAINER_TP": str(args.tp)} if args.tp else None,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from tinkerd.supervisor import SERVICES

    if args.service not in SERVICES:
        raise SystemExit(f"unknown service {args.service!r}; choose from {SERVICES}")
    os.environ["TINKERD_SERVICE"] = args.service  # names this process's fault points (libs/faults.py)
    if args.tp is not None:
        if args.service != "trainer":
            raise SystemExit("--tp applies to the trainer only")
        os.environ["TINKERD_TRAINER_TP"] = str(args.tp)
    importlib.import_module(f"services.{args.service}.__main__").main()
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from tinkerd.watch import watch_events

    try:
        asyncio.run(watch_events(_nats_url(args), replay=args.replay, subject=args.subject))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from tinkerd.watch import print_status

    state_file = layout.stack_state_file(layout.run_dir(Path(args.data_dir).expanduser().resolve()))
    asyncio.run(print_status(_nats_url(args), state_file))
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from libs.models.registry import PRESETS, ensure_tiny
    from libs.models.tiny import build_tiny

    preset = {"tiny": "tiny-qwen3"}.get(args.preset, args.preset)
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; choose from tiny, {', '.join(PRESETS)}")
    path = build_tiny(Path(args.out), preset) if args.out else ensure_tiny(Path(args.data_dir), preset)
    print(path)
    return 0


def cmd_keys_add(args: argparse.Namespace) -> int:
    from services.gateway.accounts.auth import add_key

    key = add_key(Path(args.file), args.tenant, args.name or "")
    print(key)
    return 0


def _tp(value: str) -> int:
    try:
        tp = int(value)
    except ValueError:
        tp = 0
    if tp < 1:
        raise argparse.ArgumentTypeError(f"--tp must be a positive integer, got {value!r}")
    return tp


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinkerd", description="A self-hosted server for the Tinker SDK.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start nats-server and every service, supervised (Ctrl-C stops all)")
    up.add_argument("--data-dir", default=os.environ.get("TINKERD_DATA_DIR", DEFAULT_DATA_DIR))
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--base-model", default=os.environ.get("TINKERD_BASE_MODEL", "tiny-qwen3"))
    up.add_argument("--nats", default=None, help="use this NATS server instead of starting one")
    up.add_argument("--services", default=None, help="comma-separated subset to run")
    up.add_argument(
        "--gateways", type=int, default=1, help="gateway replicas, on --port, --port + 1, ... (default 1)"
    )
    up.add_argument("--tp", type=_tp, default=None, help="tensor-parallel ranks of the trainer group (default 1)")
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="run one service in the foreground (for compose and clusters)")
    serve.add_argument("service")
    serve.add_argument(
        "--tp", type=_tp, default=None, help="trainer only: start this many tensor-parallel ranks as one group"
    )
    serve.set_defaults(func=cmd_serve)

    events = sub.add_parser("events", help="print operation events live, one line each")
    events.add_argument("--nats", default=None)
    events.add_argument("--replay", action="store_true", help="start from the oldest retained event")
    events.add_argument("--subject", default="tinker.events.>")
    events.set_defaults(func=cmd_events)

    status = sub.add_parser("status", help="services, models, sessions, trainers, queues and consumers")
    status.add_argument("--nats", default=None)
    status.add_argument(
        "--data-dir",
        default=os.environ.get("TINKERD_DATA_DIR", DEFAULT_DATA_DIR),
        help="the stack's data directory (its run/stack.json has each supervised service's state)",
    )
    status.set_defaults(func=cmd_status)

    make = sub.add_parser("make-model", help="build a deterministic tiny base model offline")
    make.add_argument("preset", nargs="?", default="tiny")
    make.add_argument("--out", default=None, help="output directory (default: DATA_DIR/models/PRESET)")
    make.add_argument("--data-dir", default=os.environ.get("TINKERD_DATA_DIR", DEFAULT_DATA_DIR))
    make.set_defaults(func=cmd_make_model)

    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="mint a key for a tenant and store its hash")
    add.add_argument("--tenant", required=True)
    add.add_argument("--file", required=True)
    add.add_argument("--name", default=None)
    add.set_defaults(func=cmd_keys_add)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
