"""Config: one schema from YAML + environment; every error names the file and field."""

from __future__ import annotations

import os
import re

import pytest

from dsv4_idxk_probe.config import ConfigError, load_config, load_file, parse_config


def env(tmp_path=None, text=None, **extra):
    values = {"DSV4_IDXK_PROBE": "1"}
    if text is not None:
        path = tmp_path / "probe.yaml"
        path.write_text(text)
        values["DSV4_IDXK_PROBE_CONFIG"] = str(path)
    values.update(extra)
    return values


def test_defaults_without_a_file():
    config = load_config(env())
    assert (config.mode, config.layout, config.step_interval, config.targets) == ("observe", "auto", 64, ("sglang",))
    assert (config.exchange.bind, config.exchange.port_base, config.exchange.fetch_always) == ("auto", 0, False)
    assert config.hicache == {}


def test_file_values_and_relative_paths(tmp_path):
    (tmp_path / "extra_layouts.yaml").write_text(
        "layouts:\n  wide:\n    slots: 64\n    tokens_per_slot: 4\n    segments: [{name: payload, slot_bytes: 512}]\n"
    )
    config = load_config(env(tmp_path, """
mode: enforce
layout: wide
layouts: extra_layouts.yaml
step_interval: 8
exchange: {port_base: 19000, timeout_ms: 50, fetch_always: true, table_size: 16}
roomlog: {dir: logs, max_files: 3, gzip: false}
metrics: {port: 9400}
digest: {collector_wait: poll}
hicache: {guard: block, flush_interval_s: 2.5}
"""))
    assert (config.mode, config.layout, config.step_interval) == ("enforce", "wide", 8)
    assert config.layouts == str(tmp_path / "extra_layouts.yaml")
    assert (config.exchange.port_base, config.exchange.timeout_ms, config.exchange.table_size) == (19000, 50, 16)
    assert (config.roomlog.dir, config.roomlog.max_files, config.roomlog.gzip) == (str(tmp_path / "logs"), 3, False)
    assert config.metrics.port == 9400
    assert config.digest.collector_wait == "poll"
    assert config.hicache == {"guard": "block", "flush_interval_s": 2.5}


@pytest.mark.parametrize("variable, file_mode, expected", [
    ("1", "enforce", "enforce"),
    ("observe", "enforce", "observe"),
    ("enforce", None, "enforce"),
    ("on", None, "observe"),
])
def test_mode_from_variable_and_file(tmp_path, variable, file_mode, expected):
    text = f"mode: {file_mode}\n" if file_mode else ""
    assert load_config(env(tmp_path, text, DSV4_IDXK_PROBE=variable)).mode == expected


@pytest.mark.parametrize("text, message", [
    ("colour: red\n", "probe.yaml:1: unknown key(s) ['colour']"),
    ("mode: loud\n", "probe.yaml:1: mode must be one of ['observe', 'enforce'], got 'loud'"),
    ("step_interval: -1\n", "probe.yaml:1: step_interval must be an integer >= 0, got -1"),
    ("exchange: {timeout_ms: fast}\n", "probe.yaml:1: exchange.timeout_ms must be an integer >= 1, got 'fast'"),
    ("exchange: {port_base: 70000}\n", "probe.yaml:1: exchange.port_base must be a port number (0-65535), got 70000"),
    ("exchange: {bind_to: x}\n", "probe.yaml:1: exchange has unknown key(s) ['bind_to']"),
    ("roomlog: {gzip: maybe}\n", "probe.yaml:1: roomlog.gzip must be true or false, got 'maybe'"),
    ("roomlog: 5\n", "probe.yaml:1: roomlog must be a mapping, got int"),
    ("digest: {collector_wait: spin}\n", "probe.yaml:1: digest.collector_wait must be one of ['block', 'poll'], got 'spin'"),
    ("targets: []\n", "probe.yaml:1: targets must be a non-empty list"),
    ("hicache: {guard: shout}\n", "probe.yaml:1: hicache.guard must be one of"),
    ("hicache: [1]\n", "probe.yaml:1: hicache must be a mapping, got list"),
    ("layouts: missing.yaml\n", "probe.yaml: layouts: "),
    # a layout no file defines: every side of every pod would be inactive, and `check` said valid
    ("layout: fp9\n", "probe.yaml: layout must be auto or one of bf16, fp4, fp4_r1"),
    ("- just\n- a list\n", "probe.yaml: the top level must be a mapping of keys, got list"),
    ("mode: [unclosed\n", "probe.yaml: not valid YAML"),
])
def test_bad_file_names_file_and_field(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(env(tmp_path, text))
    assert message in str(info.value)
    assert str(info.value).startswith(str(tmp_path / "probe.yaml"))


def test_unreadable_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope.yaml'}: cannot read config file"):
        load_file(tmp_path / "nope.yaml")


def test_bad_variable_value_is_named():
    with pytest.raises(ConfigError, match="DSV4_IDXK_PROBE='maybe' is not understood"):
        load_config({"DSV4_IDXK_PROBE": "maybe"})


def test_fault_injection_is_refused_in_enforce_mode():
    with pytest.raises(ConfigError, match="DSV4_IDXK_PROBE_FAULTS .* cannot be combined with enforce"):
        load_config(env(DSV4_IDXK_PROBE="enforce", DSV4_IDXK_PROBE_FAULTS="faults.yaml"))
    assert load_config(env(DSV4_IDXK_PROBE_FAULTS="faults.yaml")).mode == "observe"


def test_a_targets_variable_that_names_no_table_is_refused():
    """",,," left the probe patching nothing while `check` said 0/0 targets resolve, exit 0
    (found by review)."""
    with pytest.raises(ConfigError, match="DSV4_IDXK_PROBE_TARGETS names no target table, got ',, ,'"):
        load_config(env(DSV4_IDXK_PROBE_TARGETS=",, ,"))


def test_targets_variable_overrides_the_file(tmp_path):
    config = load_config(env(tmp_path, "targets: [sglang-0.5.23]\n", DSV4_IDXK_PROBE_TARGETS="fork-prefill2-decode2, x/y.yaml"))
    assert config.targets == ("fork-prefill2-decode2", "x/y.yaml")


def test_parse_config_without_document_is_defaults():
    assert parse_config(None, "<none>").exchange.table_size == 4096


def test_example_config_is_valid_and_shows_the_defaults():
    from pathlib import Path

    from dsv4_idxk_probe.config import ProbeConfig

    example = load_file(Path(__file__).resolve().parents[2] / "configs" / "probe.example.yaml")
    defaults = ProbeConfig()
    for key in ("mode", "layout", "layouts", "step_interval", "targets", "exchange", "metrics", "digest"):
        assert getattr(example, key) == getattr(defaults, key), key
    assert example.roomlog.max_bytes == defaults.roomlog.max_bytes


def test_the_example_config_names_every_key_a_config_accepts():
    """An operator copies the example: a key it leaves out is a key nobody finds."""
    from pathlib import Path

    import yaml
    from msgspec.structs import fields

    from dsv4_idxk_probe.config import _SECTION_TYPES, _TOP_KEYS
    from dsv4_idxk_probe.hicache.settings import HiCacheSettings

    document = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "probe.example.yaml").read_text())
    commented = {"layouts"}  # shown as a comment: the example must load without an extra file
    top = set(_TOP_KEYS) - commented
    assert top <= set(document), sorted(top - set(document))
    sections = {**_SECTION_TYPES, "hicache": HiCacheSettings}
    for name, cls in sections.items():
        missing = {f.name for f in fields(cls)} - set(document.get(name) or {})
        assert not missing, f"{name}: {sorted(missing)}"


@pytest.mark.parametrize("key, engine_name, refused", [("collector_wait", "WAITS", "spin"),
                                                        ("outputs", "OUTPUTS", "host"),
                                                        ("dependent_launch", "DEPENDENT_LAUNCHES", "on"),
                                                        ("collector_defer_at", "DEFER_AT", "later")])
def test_the_digest_choices_a_config_accepts_are_the_engines(key, engine_name, refused):
    """Each `digest` key accepts exactly the engine's values, its first one by default."""
    from dsv4_idxk_probe.digest import engine

    choices = getattr(engine, engine_name)
    assert getattr(parse_config({}).digest, key) == choices[0]
    for value in choices:
        assert getattr(parse_config({"digest": {key: value}}).digest, key) == value
    with pytest.raises(ConfigError, match=re.escape(f"must be one of {list(choices)}")):
        parse_config({"digest": {key: refused}})


# %% hostile files and values


def test_a_fifo_config_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "probe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=f"{fifo}: cannot read config file: not a regular file"):
        load_config({"DSV4_IDXK_PROBE": "1", "DSV4_IDXK_PROBE_CONFIG": str(fifo)})


def test_dev_zero_config_is_refused_by_type():
    with pytest.raises(ConfigError, match="/dev/zero: cannot read config file: not a regular file"):
        load_config({"DSV4_IDXK_PROBE": "1", "DSV4_IDXK_PROBE_CONFIG": "/dev/zero"})


def test_a_config_over_the_size_cap_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "probe.yaml"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match=r"probe.yaml: config file is 1,048,577 bytes, over the 1,048,576-byte limit"):
        load_file(big)


def test_a_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "probe.yaml"
    path.write_bytes(b"mode: observe\n# \xff\xfe\n")
    with pytest.raises(ConfigError, match=f"{path}: config file is not UTF-8 text \\(byte 16\\)"):
        load_file(path)


@pytest.mark.parametrize("text, message", [
    ("{1: a, foo: b}\n", "probe.yaml:1: the top level keys must be strings, got 1"),
    ("exchange: {1: a, timeout_ms: 5}\n", "probe.yaml:1: exchange keys must be strings, got 1"),
    ("hicache: {1: a, guard: block}\n", "probe.yaml:1: hicache keys must be strings, got 1"),
    ("exchange: {backoff_s: .inf}\n", "probe.yaml:1: exchange.backoff_s must be a number of seconds <= 3600, got inf"),
    ("exchange: {backoff_s: .nan}\n", "probe.yaml:1: exchange.backoff_s must be a number > 0, got nan"),
    ("exchange: {backoff_initial_s: 0}\n", "probe.yaml:1: exchange.backoff_initial_s must be a number > 0, got 0"),
    ("exchange: {retry_s: -1}\n", "probe.yaml:1: exchange.retry_s must be a number >= 0, got -1"),
    ("exchange: {retry_s: 61}\n", "probe.yaml:1: exchange.retry_s must be a number of seconds <= 60, got 61"),
    # a *_ms field's bound is in milliseconds (its refusal said seconds)
    ("digest: {collector_defer_ms: 1001}\n", "probe.yaml:1: digest.collector_defer_ms must be a number of milliseconds <= 1000, got 1001"),
    ("hicache: {restore_defer_ms: 1001}\n", "probe.yaml:1: hicache.restore_defer_ms must be a number of milliseconds <= 1000, got 1001"),
    ("roomlog: {queue_size: 1e12}\n", "probe.yaml:1: roomlog.queue_size must be an integer >= 1, got '1e12'"),
    ("roomlog: {queue_size: 1000000000000}\n", "roomlog.queue_size must be an integer <= 1_000_000, got 1_000_000_000_000"),
    ("exchange: {table_size: 1e11}\n", "probe.yaml:1: exchange.table_size must be an integer >= 1, got '1e11'"),
    ("exchange: {table_size: 100000000000}\n", "exchange.table_size must be an integer <= 1_000_000, got 100_000_000_000"),
    ("exchange: {table_size: 1.0e+11}\n", "exchange.table_size must be an integer >= 1, got 100000000000.0"),
    ("exchange: {timeout_ms: 3600000}\n", "exchange.timeout_ms must be an integer <= 60_000"),
    ("exchange: {max_request_bytes: 1073741824}\n", "exchange.max_request_bytes must be an integer <= 1_048_576"),
    ("exchange: {max_connections: 0}\n", "exchange.max_connections must be an integer >= 1, got 0"),
    ("exchange: {idle_s: -1}\n", "exchange.idle_s must be a number > 0, got -1"),
    ("roomlog: {max_bytes: 100000000000000}\n", "roomlog.max_bytes must be an integer <="),
    ("roomlog: {max_files: 1000000}\n", "roomlog.max_files must be an integer <= 10_000"),
    ("step_interval: 10000000000\n", "step_interval must be an integer <= 1_000_000"),
    ("metrics: {addr: 5}\n", "metrics.addr must be a string, got 5"),
    ("exchange: {secret_file: missing-secret}\n", "exchange.secret_file: "),
    ("mode: " + "[" * 5000 + "\n", "probe.yaml: not valid YAML"),
    ("mode: " + "[" * 5000 + "]" * 5000 + "\n", "probe.yaml: not valid YAML: nested too deeply"),
])
def test_hostile_values_are_named_errors(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(env(tmp_path, text))
    assert message in str(info.value)


def test_secret_file_from_config_or_environment(tmp_path):
    secret = tmp_path / "exchange.secret"
    secret.write_text("0123456789abcdef-cluster-secret\n")
    config = load_config(env(tmp_path, "exchange: {secret_file: exchange.secret}\n"))
    assert config.exchange.secret_file == str(secret)  # relative to the config file
    assert load_config(env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(secret))).exchange.secret_file == str(secret)
    short = tmp_path / "short"
    short.write_text("x")
    with pytest.raises(ConfigError, match="^environment: DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE: .*short: "
                                          "the exchange secret must be at least 16 bytes"):
        load_config(env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(short)))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))}.*: exchange.secret_file: .*short: the exchange"):
        load_config(env(tmp_path, "exchange: {secret_file: short}\n"))  # the config's own key: its file


def test_metrics_exporter_defaults_to_loopback():
    assert parse_config(None).metrics.addr == "127.0.0.1"


def test_retry_s_zero_means_one_try_and_is_accepted():
    config = parse_config({"exchange": {"retry_s": 0, "backoff_initial_s": 0.5}}, "probe.yaml")
    assert (config.exchange.retry_s, config.exchange.backoff_initial_s) == (0.0, 0.5)


# %% the schema's refusals: file, line and field in one message


@pytest.mark.parametrize("text, line, message", [
    ("mode: observe\nexchange:\n  timeout_ms: 50\n  bind_to: x\n", 4,
     "exchange has unknown key(s) ['bind_to']; known: ["),
    ("colour: red\n", 1, "unknown key(s) ['colour']; known: ["),
    ("mode: observe\nroomlog:\n  dir: logs\n  gzip: maybe\n", 4, "roomlog.gzip must be true or false, got 'maybe'"),
    ("step_interval: 8\n\nexchange:\n  bind: [a, b]\n", 4, "exchange.bind must be a string, got ['a', 'b']"),
    ("exchange:\n  timeout_ms: 50\nstep_interval: 8\nroomlog:\n  queue_size: 10000000\n", 5,
     "roomlog.queue_size must be an integer <= 1_000_000, got 10_000_000"),
    ("hicache:\n  io_backends:\n    - kernel\n    - ''\n", 4,
     "hicache.io_backends[1] must be a string of 1-64 characters, got ''"),
    ("hicache:\n  enabled: true\n  flush_interval_s: .inf\n", 3,
     "hicache.flush_interval_s must be a number of seconds in [0.05, 3600], got inf"),
    ("mode: observe\ntargets:\n  - sglang\n  - ''\n", 3,
     "targets must be a non-empty list of file names or paths, got ['sglang', '']"),
])
def test_an_unknown_key_a_wrong_type_and_a_number_out_of_range_name_file_line_and_field(tmp_path, text, line,
                                                                                        message):
    path = tmp_path / "probe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(env(DSV4_IDXK_PROBE_CONFIG=str(path)))
    shown = str(info.value)
    assert shown.startswith(f"{path}:{line}: {message}"), shown
    assert "\n" not in shown and "Traceback" not in shown and "$." not in shown  # one line, our field names


def test_a_long_wrong_value_is_shortened_with_its_line(tmp_path):
    path = tmp_path / "probe.yaml"
    path.write_text("mode: observe\nroomlog:\n  cluster: " + "x" * 5000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_file(path)
    shown = str(info.value)
    assert shown.startswith(f"{path}:3: roomlog.cluster must be a printable name of at most 128 characters, got 'xxx")
    assert "xxx...xxx" in shown and len(shown) < len(str(path)) + 200


def test_a_null_section_is_its_defaults_and_a_null_port_base_is_zero():
    config = parse_config({"exchange": {"port_base": None}, "roomlog": None, "hicache": None}, "probe.yaml")
    assert (config.exchange.port_base, config.roomlog.max_files, config.hicache) == (0, 8, {})


NO_SUCH_USER = "~dsv4-no-such-user-zz"


@pytest.mark.parametrize("text, field", [
    (f"roomlog: {{dir: '{NO_SUCH_USER}/logs'}}\n", "roomlog.dir"),
    (f"layouts: '{NO_SUCH_USER}/layouts.yaml'\n", "layouts"),
    (f"targets: ['{NO_SUCH_USER}/targets.yaml']\n", "targets"),
    (f"exchange: {{secret_file: '{NO_SUCH_USER}/secret'}}\n", "exchange.secret_file"),
])
def test_a_path_under_the_home_of_an_unknown_user_is_a_named_error(tmp_path, text, field):
    """pathlib's expanduser raises RuntimeError for ~user of no such user: a config error naming
    the file and the field, as for any other bad value, never an internal error."""
    with pytest.raises(ConfigError) as info:
        load_config(env(tmp_path, text))
    message = str(info.value)
    assert f"probe.yaml: {field}: '{NO_SUCH_USER}/" in message and "home directory is unknown" in message
