"""The command line: exit statuses, one-line errors, the config listing, client option parsing.

pub/sub against a running broker are tested with the broker (tests/broker/).
"""

from __future__ import annotations

import os
import re
import site
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshmq import __version__
from meshmq.cli import SPARK_MODULES, build_parser, main, render_config_reference
from meshmq.clientlink import ClientLink
from meshmq.compiled import describe
from meshmq.config import BrokerConfig, config_reference, load_config

ROOT = Path(__file__).resolve().parents[1]  # the checkout these tests run from


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port that refuses connections: bound for the test's duration, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# ---------------------------------------------------------------------------- serve


def test_serve_with_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nport = 1883\n[mqtt]\nmax_qos = 7\n")
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 2
    assert one_error_line(result) == (
        "meshmq: error: mqtt.max_qos: must be an integer between 0 and 2, got 7")
    assert result.stdout == ""


def test_serve_with_unknown_key_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[session]\nmax_queue = 5\n")
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 2
    assert one_error_line(result) == "meshmq: error: unknown key 'session.max_queue'"


def test_serve_with_bad_toml_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nport = \n")
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 2
    assert one_error_line(result).startswith(f"meshmq: error: {path}: invalid TOML: ")


def test_serve_with_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = run_cli("serve", "--config", str(tmp_path / "absent.toml"))
    assert result.returncode == 2
    assert "absent.toml: cannot read config file" in one_error_line(result)


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--port", "notanumber"], "server.port"),
        (["--port", "65536"], "server.port"),
        (["--log-level", "loud"], "server.log_level"),
        (["--log-format", "xml"], "server.log_format"),
    ],
)
def test_serve_with_bad_flag_exits_2(flags: list[str], key: str) -> None:
    result = run_cli("serve", *flags)
    assert result.returncode == 2
    assert one_error_line(result).startswith(f"meshmq: error: {key}: must be ")


def test_flags_are_checked_after_the_file(tmp_path: Path) -> None:
    """A valid file does not hide a bad flag, and the flag is the one named."""
    path = tmp_path / "ok.toml"
    path.write_text("[server]\nport = 1999\n")
    result = run_cli("serve", "--config", str(path), "--port", "-1")
    assert result.returncode == 2
    assert "server.port" in one_error_line(result)


def test_serve_rejects_unknown_flags_with_status_2() -> None:
    result = run_cli("serve", "--cluster")
    assert result.returncode == 2
    assert "unrecognized arguments: --cluster" in result.stderr


def test_serve_flags_map_to_config_keys() -> None:
    from meshmq.cli import SERVE_OVERRIDES

    args = build_parser().parse_args([
        "serve", "--bind", "127.0.0.1", "--port", "0", "--data-dir", "d", "--log-level", "debug",
        "--log-format", "json", "--port-file", "p", "--workers", "3"])
    overrides = {key: getattr(args, dest) for dest, key in SERVE_OVERRIDES.items()}
    config = load_config(overrides=overrides)
    assert config.server == type(config.server)("127.0.0.1", 0, "d", "debug", "json", "p", 3)


# ---------------------------------------------------------------------------- other commands


def test_no_command_prints_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: meshmq" in capsys.readouterr().err


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"meshmq {__version__} ({describe()})"
    assert describe() == "pure Python" or describe().startswith("compiled hot path (")


def test_config_command_prints_every_key_as_toml() -> None:
    result = run_cli("config")
    assert result.returncode == 0
    assert result.stdout == render_config_reference()
    document = tomllib.loads(result.stdout)
    for key, default, description in config_reference():
        section, name = key.split(".")
        assert document[section][name] == (list(default) if isinstance(default, tuple)
                                           else default)
        assert f"# {description} [" in result.stdout


def test_config_listing_loads_back_to_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "all.toml"
    path.write_text(render_config_reference())
    assert load_config(path) == BrokerConfig()


# ---------------------------------------------------------------------------- pub / sub options


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_pub_options() -> None:
    args = parse("pub", "-t", "a/b", "-m", "hi")
    assert (args.host, args.port, args.qos, args.mqtt_version, args.repeat) == (
        "127.0.0.1", None, 0, "5", 1)  # port None: the default of the transport chosen
    assert (args.cafile, args.cert, args.key, args.insecure, args.ws, args.ws_path) == (
        None, None, None, False, False, None)
    args = parse("pub", "-h", "broker", "-p", "1884", "-q", "2", "-r", "-V", "311", "-u", "me",
                 "-P", "pw", "-i", "cid", "--repeat", "3", "-t", "x", "-n")
    assert (args.host, args.port, args.qos, args.retain, args.mqtt_version) == (
        "broker", 1884, 2, True, "311")
    assert (args.username, args.password, args.client_id, args.repeat) == ("me", "pw", "cid", 3)
    assert args.null_message and args.message is None
    assert parse("pub", "-H", "other", "-t", "x", "-f", "payload.bin").host == "other"
    assert parse("pub", "--host", "third", "-t", "x", "-n").host == "third"
    args = parse("pub", "-t", "x", "-n", "--cafile", "ca.pem", "--cert", "c.pem", "--key",
                 "k.pem", "--insecure", "--ws", "--ws-path", "/m")
    assert (args.cafile, args.cert, args.key, args.insecure, args.ws, args.ws_path) == (
        "ca.pem", "c.pem", "k.pem", True, True, "/m")
    assert parse("sub", "-t", "x", "--tls-use-os-certs").tls_use_os_certs


def test_sub_options() -> None:
    args = parse("sub", "-t", "a/#", "-t", "b/+", "-C", "5", "-v", "-c", "-i", "me", "-x", "60")
    assert args.topic == ["a/#", "b/+"]
    assert (args.count, args.verbose, args.persistent, args.session_expiry) == (5, True, True, 60)
    args = parse("sub", "-t", "x")
    assert (args.count, args.verbose, args.persistent, args.session_expiry) == (0, False, False,
                                                                               None)


@pytest.mark.parametrize(
    "argv",
    [
        ["pub", "-t", "x"],  # no payload option
        ["pub", "-m", "x"],  # no topic
        ["pub", "-t", "x", "-m", "a", "-n"],  # two payload options
        ["pub", "-t", "x", "-m", "a", "-q", "3"],
        ["pub", "-t", "x", "-m", "a", "-V", "4"],
        ["pub", "-t", "x", "-m", "a", "-p", "70000"],
        ["pub", "-t", "x", "-m", "a", "--repeat", "0"],
        ["pub", "-t", "x", "-m", "a", "-P", "secret"],  # password without user name
        ["sub"],
        ["sub", "-t", "x", "-C", "0"],
        ["sub", "-t", "x", "-c"],  # persistent session needs a client id
        ["sub", "-t", "x", "-x", "60", "-V", "311"],  # session expiry is 5.0 only
        ["sub", "-t", "x", "-x", "-1"],
        ["pub", "-t", "x", "-m", "a", "--cert", "c.pem"],  # TLS options need a CA to trust
        ["pub", "-t", "x", "-m", "a", "--insecure"],
        ["sub", "-t", "x", "--cafile", "ca.pem", "--key", "k.pem"],  # a key needs --cert
        ["sub", "-t", "x", "--ws-path", "/mqtt"],  # without --ws
        ["pub", "-t", "x", "-m", "a", "--ws", "--ws-path", "mqtt"],
    ],
)
def test_client_usage_errors_exit_2(argv: list[str]) -> None:
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"usage: meshmq {argv[0]} ")
    assert result.stderr.splitlines()[-1].startswith(f"meshmq {argv[0]}: error: ")


@pytest.mark.parametrize(
    ("argv", "command", "unknown"),
    [
        (["sub", "-t", "x", "--bogus"], "sub", "--bogus"),
        (["pub", "-t", "x", "-m", "a", "--will-topic", "w"], "pub", "--will-topic w"),
        (["serve", "--cluster"], "serve", "--cluster"),
        (["log", "ls", "-d", "data", "--bogus"], "log ls", "--bogus"),
    ],
)
def test_an_unknown_option_prints_the_usage_of_its_command(
        argv: list[str], command: str, unknown: str) -> None:
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"usage: meshmq {command} ")
    assert result.stderr.splitlines()[-1] == (
        f"meshmq {command}: error: unrecognized arguments: {unknown}")


@pytest.mark.parametrize("command", ["pub", "sub"])
def test_client_help(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0
    assert "-H HOST, -h HOST, --host HOST" in result.stdout


def test_pub_without_a_broker_exits_1_with_one_line(closed_port: int) -> None:
    port = closed_port
    result = run_cli("pub", "-p", str(port), "-t", "a", "-m", "x", timeout=30)
    assert result.returncode == 1
    assert one_error_line(result).startswith(f"meshmq pub: cannot connect to 127.0.0.1:{port}: ")


def test_sub_without_a_broker_exits_1_with_one_line(closed_port: int) -> None:
    port = closed_port
    result = run_cli("sub", "-p", str(port), "-t", "a", timeout=30)
    assert result.returncode == 1
    assert one_error_line(result).startswith(f"meshmq sub: cannot connect to 127.0.0.1:{port}: ")


def test_pub_with_unreadable_file_exits_1(tmp_path: Path) -> None:
    result = run_cli("pub", "-t", "a", "-f", str(tmp_path / "absent.bin"))
    assert result.returncode == 1
    assert one_error_line(result) == (
        f"meshmq pub: cannot read {tmp_path / 'absent.bin'}: No such file or directory")


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ([], "127.0.0.1:1883"),
        (["--tls-use-os-certs"], "mqtts://127.0.0.1:8883"),
        (["--ws"], "ws://127.0.0.1:8083/mqtt"),
        (["--ws", "--tls-use-os-certs"], "wss://127.0.0.1:8084/mqtt"),
        (["-p", "1884", "--ws", "--ws-path", "/a/b", "-h", "broker"], "ws://broker:1884/a/b"),
    ],
)
def test_the_default_port_is_the_brokers_default_for_the_transport(
        options: list[str], where: str) -> None:
    link = ClientLink(parse("pub", *options, "-t", "x", "-n"))  # not connected
    assert link.where == where


# ---------------------------------------------------------------------------- pipeline


def test_spark_modules_are_the_spark_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["spark"]
    names = [re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)  # type: ignore[union-attr]
             for requirement in extra]
    assert sorted(name.lower() for name in names) == sorted(SPARK_MODULES)


def test_pipeline_without_the_spark_extra_names_the_install_command(tmp_path: Path) -> None:
    """In a Python that has meshmq's dependencies but not the spark extra (this venv's
    site-packages without the extra's packages), every pipeline command stops at once."""
    packages = tmp_path / "site-packages"
    packages.mkdir()
    for directory in map(Path, site.getsitepackages()):
        for entry in directory.iterdir():
            top = re.split(r"[-.]", entry.name)[0].lower()
            if top not in SPARK_MODULES and not (packages / entry.name).exists():
                (packages / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{packages}"}
    expected = (
        f"meshmq pipeline: error: the pipeline needs the spark extra "
        f"({', '.join(SPARK_MODULES)} not installed): install it with "
        f"{sys.executable} -m pip install -e '{ROOT}[spark]'")
    for job in (["demo"], ["telemetry", "--data-dir", "d", "--output", "o"], ["--help"]):
        result = subprocess.run(  # -S: no site-packages but the one made here
            [sys.executable, "-S", "-m", "meshmq", "pipeline", *job], capture_output=True,
            text=True, timeout=60, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
        assert result.returncode == 2, result.stderr
        assert one_error_line(result) == expected


def test_serve_with_a_bad_persist_filter_exits_2_before_it_starts(tmp_path: Path) -> None:
    """The bad filter is refused when the file is read, not taken to persist all of 'a/'."""
    path = tmp_path / "bad.toml"
    path.write_text('[log]\npersist_filters = "sensors/#, a/#/b"\n')
    result = run_cli("serve", "--config", str(path), "--bind", "127.0.0.1", "--port", "0",
                     "--data-dir", str(tmp_path / "data"), "--workers", "1")
    assert result.returncode == 2
    assert one_error_line(result) == ("meshmq: error: log.persist_filters: bad topic filter:"
                                      " '#' must be the whole last level: 'a/#/b'")
    assert not (tmp_path / "data").exists()  # refused before anything was opened
