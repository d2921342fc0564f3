"""Config: one schema from YAML + environment; every error names the file and field."""

from __future__ import annotations

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
    assert (config.mode, config.layout, config.step_interval, config.targets) == ("observe", "auto", 64, ("sglang-0.5.23",))
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
    ("colour: red\n", "probe.yaml: unknown key(s) ['colour']"),
    ("mode: loud\n", "probe.yaml: mode must be one of ['observe', 'enforce'], got 'loud'"),
    ("step_interval: -1\n", "probe.yaml: step_interval must be an integer >= 0, got -1"),
    ("exchange: {timeout_ms: fast}\n", "probe.yaml: exchange.timeout_ms must be an integer >= 1, got 'fast'"),
    ("exchange: {port_base: 70000}\n", "probe.yaml: exchange.port_base must be a port number (0-65535), got 70000"),
    ("exchange: {bind_to: x}\n", "probe.yaml: exchange has unknown key(s) ['bind_to']"),
    ("roomlog: {gzip: maybe}\n", "probe.yaml: roomlog.gzip must be true or false, got 'maybe'"),
    ("roomlog: 5\n", "probe.yaml: roomlog must be a mapping, got int"),
    ("digest: {collector_wait: spin}\n", "probe.yaml: digest.collector_wait must be one of ['block', 'poll'], got 'spin'"),
    ("targets: []\n", "probe.yaml: targets must be a non-empty list"),
    ("hicache: {guard: shout}\n", "probe.yaml: hicache.guard must be one of"),
    ("hicache: [1]\n", "probe.yaml: hicache must be a mapping, got list"),
    ("layouts: missing.yaml\n", "probe.yaml: layouts: "),
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


def test_the_collector_waits_a_config_accepts_are_the_engines():
    from dsv4_idxk_probe.digest.engine import WAITS

    for wait in WAITS:
        assert parse_config({"digest": {"collector_wait": wait}}).digest.collector_wait == wait
    with pytest.raises(ConfigError, match=re.escape(f"must be one of {list(WAITS)}")):
        parse_config({"digest": {"collector_wait": "spin"}})
