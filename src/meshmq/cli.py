"""Command line: ``meshmq serve | pub | sub | call | worker | passwd | log | state | cluster |
pipeline | config``.

Exit status 2 means bad usage or bad configuration (one line on stderr); ``serve`` otherwise
returns what the broker returns.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from meshmq import __version__
from meshmq.auth.cli import add_passwd_command
from meshmq.clients import add_client_commands
from meshmq.config import ConfigError, allowed_values, config_reference, load_config
from meshmq.log.cli import add_log_command
from meshmq.node.clustercli import add_cluster_command
from meshmq.servicecli import add_service_commands
from meshmq.state.cli import add_state_command

# serve flag (argparse dest) -> configuration key it overrides
SERVE_OVERRIDES = {
    "bind": "server.bind",
    "port": "server.port",
    "data_dir": "server.data_dir",
    "log_level": "server.log_level",
    "log_format": "server.log_format",
    "port_file": "server.port_file",
    "workers": "server.workers",
}

# The modules of the spark extra (pyproject.toml): the pipeline needs every one of them.
SPARK_MODULES = ("matplotlib", "numpy", "pyarrow", "pyspark")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pipeline"]:  # own parser, imported late: only the pipeline needs pyspark
        return _pipeline(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the usage shown is the (sub-)command's whose options were given
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.run(args) or 0)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace
                   ) -> argparse.ArgumentParser:
    """The parser of the innermost sub-command ``args`` chose (``meshmq log dump``: dump's)."""
    while True:
        choosers = [action for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction)]
        chosen = getattr(args, choosers[0].dest, None) if choosers else None
        if chosen is None:
            return parser
        parser = choosers[0].choices[chosen]


def _pipeline(argv: list[str]) -> int:
    """``meshmq pipeline ARGS``, or one line naming how to install the spark extra (status 2)."""
    missing = [name for name in SPARK_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(f"meshmq pipeline: error: the pipeline needs the spark extra ({', '.join(missing)}"
              f" not installed): {spark_install_hint()}", file=sys.stderr)
        return 2
    try:
        from meshmq.pipeline.cli import main as pipeline_main
    except ImportError as exc:  # installed, yet broken
        print(f"meshmq pipeline: error: {exc}: {spark_install_hint()}", file=sys.stderr)
        return 2
    return pipeline_main(argv)


def spark_install_hint() -> str:
    """The command that installs the spark extra into the Python running this."""
    root = Path(__file__).resolve().parents[2]  # a source checkout: src/meshmq/cli.py
    if not (root / "pyproject.toml").is_file():
        return f"install it with {sys.executable} -m pip install 'meshmq[spark]'"
    if root == Path.cwd().resolve():
        python = os.path.relpath(sys.executable) if sys.executable.startswith(f"{root}{os.sep}") \
            else sys.executable
        return f"run make demo, or install it with {python} -m pip install -e '.[spark]'"
    return f"install it with {sys.executable} -m pip install -e '{root}[spark]'"


class VersionAction(argparse.Action):
    """``--version``: the version and how the hot path runs (compiled or pure Python), found
    only when asked (it imports the broker's modules)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        from meshmq.compiled import describe
        print(f"meshmq {__version__} ({describe()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshmq", description="meshmq MQTT broker")
    parser.add_argument("--version", action=VersionAction, nargs=0,
                        help="show the version and whether the hot path is compiled, and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run a broker node",
        description="Run a broker node until SIGTERM or SIGINT. Flags override the file.")
    serve.add_argument("--config", metavar="PATH", help="TOML configuration file")
    serve.add_argument("--bind", metavar="HOST", help="listen address (server.bind)")
    serve.add_argument("--port", metavar="N", help="MQTT TCP port, 0 = any free (server.port)")
    serve.add_argument("--data-dir", metavar="DIR", help="data directory (server.data_dir)")
    serve.add_argument("--log-level", metavar="LEVEL",
                       help="debug|info|warning|error (server.log_level)")
    serve.add_argument("--log-format", metavar="FORMAT", help="text|json (server.log_format)")
    serve.add_argument("--port-file", metavar="PATH",
                       help="write the bound port to PATH once listening (server.port_file)")
    serve.add_argument("--workers", metavar="N",
                       help="broker processes, 0 = one per CPU (server.workers)")
    serve.set_defaults(run=_serve)

    add_client_commands(commands)
    add_service_commands(commands)
    add_passwd_command(commands)
    add_log_command(commands)
    add_state_command(commands)
    add_cluster_command(commands)
    commands.add_parser("pipeline", help="run a Spark job over the commit log "
                        "(meshmq pipeline --help)")  # parsed by meshmq.pipeline.cli

    config = commands.add_parser(
        "config", help="print every configuration key with its default",
        description="Print every configuration key with its default and meaning, as TOML.")
    config.set_defaults(run=_print_config)
    return parser


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, object] = {
        key: getattr(args, dest)
        for dest, key in SERVE_OVERRIDES.items()
        if getattr(args, dest) is not None
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"meshmq: error: {exc}", file=sys.stderr)
        return 2

    from meshmq.logsetup import configure_logging
    from meshmq.node.reload import ConfigSource
    from meshmq.node.run import run_server  # imported late: only serve needs the broker

    configure_logging(config.server.log_level, config.server.log_format)
    return run_server(config, ConfigSource(args.config, overrides))


def toml_value(value: object) -> str:
    """``value`` written as a TOML literal (bool, int, float, str or an array of strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(item) for item in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(name)} = {toml_value(item)}"
                               for name, item in value.items()) + "}"
    return repr(value)


def render_config_reference() -> str:
    """Every key as a TOML document of the defaults, each key under its description."""
    lines = ["# meshmq configuration: every key, set to its default (`meshmq config`)."]
    section = ""
    for key, default, description in config_reference():
        table, name = key.split(".", 1)
        if table != section:
            lines += ["", f"[{table}]"]
            section = table
        lines.append(f"# {description} [{allowed_values(key)}]")
        lines.append(f"{name} = {toml_value(default)}")
    return "\n".join(lines) + "\n"


def _print_config(args: argparse.Namespace) -> int:
    sys.stdout.write(render_config_reference())
    return 0
