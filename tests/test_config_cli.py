"""Configuration loading and the command line: defaults, overrides, one-line errors, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshmq.config import BrokerConfig, ConfigError, config_reference, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "meshmq.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_embedded_single_node() -> None:
    config = load_config()
    assert config == BrokerConfig()
    assert (config.server.port, config.server.data_dir) == (1883, "./data")


def test_file_and_overrides_apply_in_order(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nport = 1999\n[mqtt]\nmax_qos = 1\nconnect_timeout = 3\n')
    config = load_config(path, {"server.port": "2000"})
    assert config.server.port == 2000
    assert config.mqtt.max_qos == 1
    assert config.mqtt.connect_timeout == 3.0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[mqtt]\nfoo = 1\n", "mqtt.foo"),
        ("[mqtt]\nmax_qos = 3\n", "mqtt.max_qos"),
        ("[mqtt]\nmax_qos = true\n", "mqtt.max_qos"),
        ('[mqtt]\nretain_available = "yes"\n', "mqtt.retain_available"),
        ('[session]\nqueue_drop_policy = "random"\n', "session.queue_drop_policy"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[cluster]\nx = 1\n", "cluster"),
        ("[server\nport = 1\n", "invalid TOML"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert key in str(info.value)
    assert "\n" not in str(info.value)


def test_every_key_is_documented() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for key, _default, description in config_reference():
        assert f"`{key}`" in docs and description


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", *args], capture_output=True,
                          text=True, timeout=60)


def test_serve_with_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_cli("serve", "--config", str(write(tmp_path, "[mqtt]\nmax_qos = 7\n")))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "mqtt.max_qos" in lines[0]


def test_serve_with_bad_flag_exits_2() -> None:
    result = run_cli("serve", "--port", "notanumber")
    assert result.returncode == 2
    assert "server.port" in result.stderr


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    result = run_cli("serve", "--config", str(tmp_path / "absent.toml"))
    assert result.returncode == 2
    assert "absent.toml" in result.stderr


def test_config_command_lists_every_key() -> None:
    result = run_cli("config")
    assert result.returncode == 0
    for key, _default, _ in config_reference():
        assert f"{key.split('.', 1)[1]} = " in result.stdout
