"""Command line: ``meshmq serve | pub | sub | config``."""

from __future__ import annotations

import argparse
import sys

from meshmq.config import ConfigError, config_reference, load_config


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.run(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshmq", description="meshmq MQTT broker")
    commands = parser.add_subparsers(dest="command")

    serve = commands.add_parser("serve", help="run a broker node")
    serve.add_argument("--config", metavar="PATH", help="TOML configuration file")
    serve.add_argument("--bind", metavar="HOST", help="listen address (server.bind)")
    serve.add_argument("--port", metavar="N", help="MQTT TCP port (server.port)")
    serve.add_argument("--data-dir", metavar="DIR", help="data directory (server.data_dir)")
    serve.add_argument("--log-level", metavar="LEVEL", help="debug|info|warning|error")
    serve.add_argument("--port-file", metavar="PATH", help="write the bound port here")
    serve.set_defaults(run=_serve)

    from meshmq.clients import add_client_commands

    add_client_commands(commands)

    config = commands.add_parser("config", help="list every configuration key and default")
    config.set_defaults(run=_print_config)
    return parser


def _serve(args: argparse.Namespace) -> int:
    overrides = {
        key: value
        for key, value in (
            ("server.bind", args.bind), ("server.port", args.port),
            ("server.data_dir", args.data_dir), ("server.log_level", args.log_level),
            ("server.port_file", args.port_file),
        )
        if value is not None
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"meshmq: error: {exc}", file=sys.stderr)
        return 2
    from meshmq.broker.server import run_server
    from meshmq.logsetup import configure_logging

    configure_logging(config.server.log_level, config.server.log_format)
    return run_server(config)


def _print_config(args: argparse.Namespace) -> int:
    section = ""
    for key, default, description in config_reference():
        table, name = key.split(".", 1)
        if table != section:
            print(f"{'' if not section else chr(10)}[{table}]")
            section = table
        value = str(default).lower() if isinstance(default, bool) else default
        value = f'"{value}"' if isinstance(default, str) else value
        print(f"# {description}\n{name} = {value}")
    return 0
