"""Configuration loading: defaults, TOML file, overrides, one-line errors naming the key."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshmq.cli import render_config_reference, toml_value
from meshmq.config import (
    _KEYS,
    BrokerConfig,
    ConfigError,
    ServerConfig,
    allowed_values,
    config_reference,
    listen_address,
    load_config,
)

DOCS = Path(__file__).parents[1] / "docs"


def write(tmp_path: Path, text: str | bytes, name: str = "meshmq.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------- defaults


def test_defaults_are_the_embedded_single_node() -> None:
    config = load_config()
    assert config == BrokerConfig()
    assert config.server == ServerConfig("", 1883, "./data", "info", "text", "")
    assert config.mqtt.max_packet_size == 1_048_576
    assert config.mqtt.receive_maximum == 1024
    assert config.mqtt.connect_timeout == 10.0
    assert config.session.max_session_expiry == 4_294_967_295
    assert config.session.queue_drop_policy == "drop_oldest"
    assert config.session.queue_qos0 is False


def test_an_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == BrokerConfig()
    assert load_config(write(tmp_path, "[server]\n[mqtt]\n[session]\n")) == BrokerConfig()


def test_configs_are_frozen() -> None:
    config = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]


def test_the_key_table_covers_every_field_once() -> None:
    fields = [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(BrokerConfig)
        for f in dataclasses.fields(section.type if isinstance(section.type, type)
                                    else getattr(BrokerConfig(), section.name).__class__)
    ]
    assert [key for key, _, _ in config_reference()] == fields
    for key, default, description in config_reference():
        section, name = key.split(".")
        assert default == getattr(getattr(BrokerConfig(), section), name)
        assert description and "\n" not in description
        # every default passes its own validation
        assert load_config(overrides={key: default}) == BrokerConfig()


# ---------------------------------------------------------------------------- file and overrides


def test_file_values_are_applied(tmp_path: Path) -> None:
    path = write(tmp_path, """
[server]
bind = "127.0.0.1"
port = 1999
data_dir = "/var/lib/meshmq"
log_level = "debug"
log_format = "json"

[mqtt]
max_qos = 1
retain_available = false
connect_timeout = 3          # an integer is fine for a number
max_packet_size = 268435455

[session]
queue_qos0 = true
queue_drop_policy = "drop_newest"
max_queued_bytes = 1
""")
    config = load_config(path)
    assert config.server == ServerConfig("127.0.0.1", 1999, "/var/lib/meshmq", "debug", "json", "")
    assert (config.mqtt.max_qos, config.mqtt.retain_available) == (1, False)
    assert config.mqtt.connect_timeout == 3.0 and isinstance(config.mqtt.connect_timeout, float)
    assert config.mqtt.max_packet_size == 268_435_455
    assert config.mqtt.receive_maximum == 1024  # untouched keys keep their defaults
    assert config.session.queue_qos0 is True
    assert config.session.queue_drop_policy == "drop_newest"
    assert config.session.max_queued_bytes == 1


def test_overrides_apply_after_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 1999\nbind = '10.0.0.1'\n[mqtt]\nmax_qos = 1\n")
    config = load_config(path, {"server.port": 2000, "mqtt.connect_timeout": 0.25})
    assert config.server.port == 2000
    assert config.server.bind == "10.0.0.1"
    assert config.mqtt.max_qos == 1
    assert config.mqtt.connect_timeout == 0.25


def test_overrides_without_a_file() -> None:
    config = load_config(overrides={"server.port": 0, "session.queue_qos0": True})
    assert config.server.port == 0
    assert config.session.queue_qos0 is True


def test_string_overrides_are_parsed_like_command_line_text() -> None:
    config = load_config(overrides={
        "server.port": "2000", "mqtt.connect_timeout": "0.5", "mqtt.retain_available": "False",
        "session.queue_qos0": "true", "server.bind": "::1",
    })
    assert config.server.port == 2000
    assert config.mqtt.connect_timeout == 0.5
    assert config.mqtt.retain_available is False
    assert config.session.queue_qos0 is True
    assert config.server.bind == "::1"


def test_string_values_in_the_file_are_not_parsed(tmp_path: Path) -> None:
    message = error_for(tmp_path, '[server]\nport = "1883"\n')
    assert message == "server.port: must be an integer between 0 and 65535, got '1883'"


def test_error_message_format() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"mqtt.max_packet_size": "abc"})
    assert str(info.value) == (
        "mqtt.max_packet_size: must be an integer between 1 and 268435455, got 'abc'")


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[mqtt]\nfoo = 1\n", "unknown key 'mqtt.foo'"),
        ("[server]\nport = 1883\nhost = 'x'\n", "unknown key 'server.host'"),
        ("[mqtt.limits]\nx = 1\n", "unknown key 'mqtt.limits'"),
        ("[replication]\nx = 1\n", "unknown table 'replication'"),
        ("port = 1883\n", "unknown key 'port'"),
        ("server = 1\n", "server: must be a table, got 1"),
    ],
)
def test_unknown_keys_and_tables_are_named(tmp_path: Path, text: str, message: str) -> None:
    assert error_for(tmp_path, text) == message


@pytest.mark.parametrize(
    ("text", "key", "rule"),
    [
        ("[mqtt]\nmax_qos = true\n", "mqtt.max_qos", "an integer"),  # bool is not an int
        ("[mqtt]\nmax_qos = 1.0\n", "mqtt.max_qos", "an integer"),
        ('[mqtt]\nretain_available = "yes"\n', "mqtt.retain_available", "true or false"),
        ("[mqtt]\nretain_available = 1\n", "mqtt.retain_available", "true or false"),
        ('[mqtt]\nconnect_timeout = "1"\n', "mqtt.connect_timeout", "a number"),
        ("[mqtt]\nconnect_timeout = false\n", "mqtt.connect_timeout", "a number"),
        ("[server]\nbind = 5\n", "server.bind", "a string"),
        ("[server]\ndata_dir = ['a']\n", "server.data_dir", "a string"),
        ("[server]\nport = { a = 1 }\n", "server.port", "an integer"),
        ("[session]\nqueue_qos0 = 0\n", "session.queue_qos0", "true or false"),
    ],
)
def test_wrong_types_name_the_key(tmp_path: Path, text: str, key: str, rule: str) -> None:
    message = error_for(tmp_path, text)
    assert message.startswith(f"{key}: must be {rule}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nport = 70000\n",
         "server.port: must be an integer between 0 and 65535, got 70000"),
        ("[server]\nport = -1\n", "server.port: must be an integer between 0 and 65535, got -1"),
        ("[mqtt]\nmax_qos = 3\n", "mqtt.max_qos: must be an integer between 0 and 2, got 3"),
        ("[mqtt]\nreceive_maximum = 0\n",
         "mqtt.receive_maximum: must be an integer between 1 and 65535, got 0"),
        ("[mqtt]\nmax_keepalive = 65536\n",
         "mqtt.max_keepalive: must be an integer between 1 and 65535, got 65536"),
        ("[mqtt]\nmax_packet_size = 268435456\n",
         "mqtt.max_packet_size: must be an integer between 1 and 268435455, got 268435456"),
        ("[mqtt]\nconnect_timeout = 0\n",
         "mqtt.connect_timeout: must be a number greater than 0, got 0"),
        ("[mqtt]\nconnect_timeout = -0.5\n",
         "mqtt.connect_timeout: must be a number greater than 0, got -0.5"),
        ("[mqtt]\nconnect_timeout = inf\n",
         "mqtt.connect_timeout: must be a number greater than 0, got inf"),
        ("[mqtt]\nconnect_timeout = nan\n",
         "mqtt.connect_timeout: must be a number greater than 0, got nan"),
        ("[mqtt]\nsys_interval = -1\n",
         "mqtt.sys_interval: must be a number of at least 0, got -1"),
        ("[mqtt]\nsys_interval = inf\n",
         "mqtt.sys_interval: must be a number of at least 0, got inf"),
        ("[session]\nmax_session_expiry = 4294967296\n",
         "session.max_session_expiry: must be an integer between 0 and 4294967295, "
         "got 4294967296"),
        ("[session]\nmax_queued_messages = 0\n",
         "session.max_queued_messages: must be an integer of at least 1, got 0"),
        ('[session]\nqueue_drop_policy = "random"\n',
         "session.queue_drop_policy: must be one of drop_oldest|drop_newest, got 'random'"),
        ('[server]\nlog_level = "INFO"\n',
         "server.log_level: must be one of debug|info|warning|error, got 'INFO'"),
        ('[server]\nlog_format = "xml"\n',
         "server.log_format: must be one of text|json, got 'xml'"),
        ('[hooks]\nurl = "ftp://example.com/x"\n',
         "hooks.url: must be an http:// or https:// URL (or empty), got 'ftp://example.com/x'"),
        ('[hooks]\nevents = "client_connected, subscribe"\n',
         "hooks.events: unknown event 'subscribe' (known: client_connected,"
         " client_disconnected, publish)"),
        ('[hooks]\npublish_filters = "a/#/b"\n',
         "hooks.publish_filters: bad topic filter: '#' must be the whole last level: 'a/#/b'"),
        ('[hooks]\npublish_filters = "a/#, $share/g/b"\n',
         "hooks.publish_filters: bad topic filter: a shared subscription is no filter here:"
         " '$share/g/b'"),
        ("[hooks]\ntimeout = 0\n", "hooks.timeout: must be a number greater than 0, got 0"),
    ],
)
def test_out_of_range_values_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    assert error_for(tmp_path, text) == message


@pytest.mark.parametrize(
    ("key", "value"),
    [("server.port", 0), ("server.port", 65535), ("mqtt.max_packet_size", 1),
     ("mqtt.max_qos", 0), ("mqtt.topic_alias_maximum", 0), ("mqtt.broker_topic_aliases", 65535),
     ("mqtt.connect_timeout", 0.001), ("session.max_session_expiry", 0),
     ("session.max_queued_messages", 10**9), ("mqtt.sys_interval", 0.0)],
)
def test_bounds_are_inclusive(key: str, value: object) -> None:
    section, name = key.split(".")
    assert getattr(getattr(load_config(overrides={key: value}), section), name) == value


def test_sys_interval_0_in_a_file_means_no_sys_topics(tmp_path: Path) -> None:
    """Documented as "0 = no $SYS topics", so 0 is a valid value (not a number > 0)."""
    config = load_config(write(tmp_path, "[mqtt]\nsys_interval = 0\n"))
    assert config.mqtt.sys_interval == 0.0


# (the replication keys are also checked against each other, which the cases of the
# cluster checks below cover: in range alone does not make them accepted)
_INT_KEYS = sorted(key for key, spec in _KEYS.items() if spec.kind is int
                   and key not in ("log.replication_factor", "log.min_insync_replicas"))


@given(key=st.sampled_from(_INT_KEYS), value=st.integers(-(2**33), 2**33))
def test_integers_are_accepted_exactly_within_range(key: str, value: int) -> None:
    low, high = _KEYS[key].allowed  # type: ignore[misc]
    inside = low <= value and (high is None or value <= high)
    try:
        load_config(overrides={key: value})
    except ConfigError as exc:
        assert not inside
        assert str(exc).startswith(f"{key}: ") and str(value) in str(exc)
    else:
        assert inside


def test_bad_toml_names_the_file_and_keeps_tomllibs_message(tmp_path: Path) -> None:
    text = "[server\nport = 1\n"
    with pytest.raises(tomllib.TOMLDecodeError) as parse:
        tomllib.loads(text)
    message = error_for(tmp_path, text)
    path = str(tmp_path / "meshmq.toml")
    assert message == f"{path}: invalid TOML: {parse.value}"


def test_duplicate_keys_are_a_toml_error(tmp_path: Path) -> None:
    message = error_for(tmp_path, "[server]\nport = 1\nport = 2\n")
    assert "meshmq.toml: invalid TOML:" in message


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.toml")
    assert str(info.value) == (
        f"{tmp_path / 'absent.toml'}: cannot read config file: No such file or directory")


def test_directory_and_binary_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="invalid TOML: the file is not UTF-8"):
        load_config(write(tmp_path, b"[server]\nbind = '\xff'\n"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"server.foo": 1}, "unknown key 'server.foo'"),
        ({"port": 1}, "unknown key 'port'"),
        ({"server.port": "notanumber"},
         "server.port: must be an integer between 0 and 65535, got 'notanumber'"),
        ({"server.port": "1e3"}, "server.port: must be an integer between 0 and 65535, got '1e3'"),
        ({"server.port": True}, "server.port: must be an integer between 0 and 65535, got true"),
        ({"server.port": None}, "server.port: must be an integer between 0 and 65535, got None"),
        ({"mqtt.retain_available": "yes"},
         "mqtt.retain_available: must be true or false, got 'yes'"),
        ({"server.log_level": "loud"},
         "server.log_level: must be one of debug|info|warning|error, got 'loud'"),
    ],
)
def test_bad_overrides_name_the_key(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert str(info.value) == message


def test_an_override_does_not_excuse_a_bad_file_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^mqtt\.max_qos: "):
        load_config(write(tmp_path, "[mqtt]\nmax_qos = 9\n"), {"mqtt.max_qos": 1})


# ---------------------------------------------------------------------------- documentation


def test_configuration_md_lists_every_key_as_the_code_does() -> None:
    docs = (DOCS / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| (.*) \|$", docs, re.MULTILINE)
    expected = [
        (key, f"`{toml_value(default)}` | {allowed_values(key).replace('|', chr(92) + '|')} | "
              f"{description}")
        for key, default, description in config_reference()
    ]
    assert rows == expected, "docs/configuration.md is out of date with meshmq.config"


def test_configuration_md_example_is_valid(tmp_path: Path) -> None:
    docs = (DOCS / "configuration.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", docs, re.DOTALL)
    assert blocks
    for block in blocks:
        load_config(write(tmp_path, block))


def test_example_toml_is_the_config_listing_and_holds_the_defaults() -> None:
    example = DOCS / "example.toml"
    assert example.read_text() == render_config_reference(), (
        "regenerate with: .venv/bin/meshmq config > docs/example.toml")
    assert load_config(example) == BrokerConfig()


def test_hook_lists_are_split_on_commas(tmp_path: Path) -> None:
    hooks = load_config(write(tmp_path, '[hooks]\nurl = "https://h.example/x"\n'
                                        'events = " publish ,client_connected"\n'
                                        'publish_filters = "a/+, b/#,"\n')).hooks
    assert hooks.event_names == {"publish", "client_connected"}
    assert hooks.filters == ("a/+", "b/#")


# ---------------------------------------------------------------------------- log filters


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[log]\npersist_filters = "a/#/b"\n',
         "log.persist_filters: bad topic filter: '#' must be the whole last level: 'a/#/b'"),
        ('[log]\npersist_filters = "telemetry/#, a/+b"\n',
         "log.persist_filters: bad topic filter: '+' must occupy a whole level: 'a/+b'"),
        ('[log]\npersist_filters = "$share/g/a"\n',
         "log.persist_filters: bad topic filter: a shared subscription is no filter here:"
         " '$share/g/a'"),
        ('[log]\nfsync_rules = "a/#/b=always"\n',
         "log.fsync_rules: bad topic filter: '#' must be the whole last level: 'a/#/b'"),
        ('[log]\nfsync_rules = "cmd/#=always, =interval"\n',
         "log.fsync_rules: bad topic filter: empty topic filter: ''"),
        ('[log]\nfsync_rules = "telemetry/#=sometimes"\n',
         "log.fsync_rules: 'telemetry/#=sometimes' is not FILTER=always|interval|never"),
        ('[log]\nfsync_rules = "telemetry/#"\n',
         "log.fsync_rules: 'telemetry/#' is not FILTER=always|interval|never"),
    ],
)
def test_log_topic_filters_are_checked(tmp_path: Path, text: str, message: str) -> None:
    """A bad filter in these keys would persist (or fsync) other topics than meant: 'a/#/b'
    matched everything under 'a/'. They are checked as hooks.publish_filters is."""
    assert error_for(tmp_path, text) == message


def test_good_log_topic_filters_load(tmp_path: Path) -> None:
    log = load_config(write(tmp_path, '[log]\npersist_filters = "telemetry/+/temp, cmd/#, #,"\n'
                                      'fsync_rules = " telemetry/#=interval , cmd/+=always,"\n'
                                      )).log
    assert log.persist_filters == "telemetry/+/temp, cmd/#, #,"
    assert log.fsync_rules == " telemetry/#=interval , cmd/+=always,"


# ---------------------------------------------------------------------------- where it listens


@pytest.mark.parametrize(("auth", "bind", "address"), [
    ("", "", "127.0.0.1"),  # no configuration: loopback only, as Mosquitto 2
    ('password_file = "pw"\n', "", "0.0.0.0"),  # authentication: open as before
    ('password_file = "pw"\nanonymous = "allow"\n', "", "127.0.0.1"),
    ('anonymous = "deny"\n', "", "0.0.0.0"),  # nobody gets in without a password anyway
    ("", "0.0.0.0", "0.0.0.0"),  # an explicit address is used as given
    ("", "127.0.0.1", "127.0.0.1"),
    ('password_file = "pw"\n', "10.1.2.3", "10.1.2.3"),
])
def test_an_empty_server_bind_is_loopback_while_anonymous_clients_are_allowed(
    tmp_path: Path, auth: str, bind: str, address: str,
) -> None:
    text = f"[auth]\n{auth}" + (f'[server]\nbind = "{bind}"\n' if bind else "")
    assert listen_address(load_config(write(tmp_path, text))) == address


# ---------------------------------------------------------------------------- [cluster]


@pytest.mark.parametrize("text, message", [
    ('[log]\nreplication_factor = 3\n',
     "log.replication_factor: must be 1: partitions are not replicated yet"),
    ('[log]\nmin_insync_replicas = 2\n',
     "log.min_insync_replicas: must be at most log.replication_factor (1), got 2"),
    ('[cluster]\nlisten = "127.0.0.1:7883"\n',
     "cluster.node_id: required when cluster.listen is set"),
    ('[cluster]\nnode_id = "n1"\n', "cluster.listen: required when cluster.node_id is set"),
    ('[cluster]\nnode_id = "n1"\nlisten = "0.0.0.0:7883"\n',
     "cluster.secret_file: required when cluster.listen (0.0.0.0:7883) is not a loopback"),
    ('[cluster]\nnode_id = "n1"\nlisten = "10.0.0.1:7883"\n',
     "cluster.secret_file: required when cluster.listen"),
    ('[cluster]\nnode_id = "n 1"\nlisten = "127.0.0.1:7883"\n',
     "cluster.node_id: must be 1 to 63 letters"),
    ('[cluster]\nnode_id = "n1"\nlisten = "7883"\n', "cluster.listen: must be HOST:PORT"),
    ('[cluster]\nnode_id = "n1"\nlisten = "127.0.0.1:7883"\nseeds = "10.0.0.2:7883"\n',
     "cluster.seeds: must be an array of strings, got '10.0.0.2:7883'"),
    ('[cluster]\nnode_id = "n1"\nlisten = "127.0.0.1:7883"\nseeds = ["10.0.0.2"]\n',
     "cluster.seeds: must be HOST:PORT"),
    ('[cluster]\nnode_id = "n1"\nlisten = "127.0.0.1:7883"\nseeds = ["127.0.0.1:7883"]\n',
     "cluster.seeds: lists only this node's own address"),
])
def test_cluster_keys_are_checked_together(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    assert str(error.value).startswith(message), str(error.value)


def test_a_cluster_node_loads_with_the_contract_keys(tmp_path: Path) -> None:
    secret = tmp_path / "cluster.secret"
    secret.write_text("s3cret\n")
    config = load_config(write(tmp_path, f"""
[cluster]
node_id = "n1"
listen = "0.0.0.0:7883"
advertise = "10.0.0.1:7883"
seeds = ["10.0.0.2:7883", "10.0.0.3:7883"]
secret_file = "{secret}"

[log]
replication_factor = 1
min_insync_replicas = 1
"""))
    cluster = config.cluster
    assert cluster.enabled and cluster.seeds == ("10.0.0.2:7883", "10.0.0.3:7883")
    assert cluster.advertised == "10.0.0.1:7883"
    assert load_config(overrides={"cluster.node_id": "n2", "cluster.listen": "127.0.0.1:7883",
                                  "cluster.seeds": "127.0.0.1:7884,127.0.0.1:7885"}
                       ).cluster.seeds == ("127.0.0.1:7884", "127.0.0.1:7885")
    assert not load_config().cluster.enabled  # no [cluster]: today's single node
