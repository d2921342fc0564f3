"""Hostile configuration input (reliability round two): alias bombs, duplicate keys,
numbers past every bound, a secret file others may read or write, and a target table
whose `hook` names code outside the probe. Each is a named error (exit 2 from `check`),
found in bounded time and memory; none is a traceback, a hang or an exit 3."""

from __future__ import annotations

import argparse
import logging
import math
import re
import resource
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import wrapt
from prometheus_client import CollectorRegistry

from dsv4_idxk_probe import activation, safety
from dsv4_idxk_probe.cli import check
from dsv4_idxk_probe.config import ConfigError, load_config, load_file, parse_config
from dsv4_idxk_probe.sglang.targets import Target, TargetFileError, parse_target_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def alias_bomb(levels: int = 9) -> str:
    """'Billion laughs' in YAML flow style: 9 anchors, each a list of 9 aliases of the one before
    (9**9 strings once followed), ~470 bytes with its key."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


@contextmanager
def bounded(seconds: float = 1.0, rss_mib: int = 200):
    """The block must finish within `seconds` and grow the process's peak RSS by less than
    `rss_mib` (an alarm cuts a runaway short where Python gets control back)."""

    def expire(*_):
        raise TimeoutError(f"still running after {10 * seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 10 * seconds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert grown < rss_mib, f"peak RSS grew by {grown:.0f} MiB"


def write(tmp_path, text, name="probe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def env(config=None, **extra):
    values = {"DSV4_IDXK_PROBE": "1", **extra}
    if config is not None:
        values["DSV4_IDXK_PROBE_CONFIG"] = str(config)
    return values


def run_check(monkeypatch, capsys, environment, *targets):
    for key in ("DSV4_IDXK_PROBE_CONFIG", "DSV4_IDXK_PROBE_TARGETS", "DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE",
                "SGLANG_PLUGINS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    rc = check.main(argparse.Namespace(targets=list(targets) or None, json=False))
    return rc, capsys.readouterr()


def squeezed(text: str) -> str:
    """`text` without whitespace: `check` wraps its lines at 100 columns, paths included."""
    return "".join(text.split())


def shows(message: str, output: str) -> bool:
    return squeezed(message) in squeezed(output)


# %% 1. YAML: alias bombs, duplicate keys, bounded documents


@pytest.mark.parametrize("key", ["mode", "targets", "hicache:\n  io_backends"])
def test_an_alias_bomb_in_the_probe_config_is_refused_at_once(tmp_path, key):
    path = write(tmp_path, f"{key}: {alias_bomb()}\n")
    assert len(path.read_bytes()) < 520
    with bounded(), pytest.raises(ConfigError) as info:
        load_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}:") and "anchors and aliases are not accepted" in message
    assert len(message) < 300


def test_an_alias_bomb_keeps_install_off_quickly(tmp_path, caplog):
    path = write(tmp_path, f"mode: {alias_bomb()}\n")
    activation.uninstall()
    try:
        with bounded(), caplog.at_level(logging.ERROR, logger="dsv4_idxk_probe"):
            assert activation.install(env(path), registry=CollectorRegistry(), emit=lambda r: None) is False
    finally:
        activation.uninstall()
    assert "anchors and aliases are not accepted" in caplog.text


def test_an_alias_bomb_makes_check_exit_2_quickly(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, f"targets: {alias_bomb()}\n")
    with bounded(5.0):  # `check` imports the CLI's modules on its first run
        rc, out = run_check(monkeypatch, capsys, env(path))
    assert rc == 2 and shows("anchors and aliases are not accepted", out.err) and len(out.err) < 400


def test_an_alias_bomb_in_a_target_table_is_refused_at_once(tmp_path, monkeypatch, capsys):
    text = ("targets:\n  - {name: a, module: m, qualname: C.f, kind: after, required: true, role: any,\n"
            f"     hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', params: {alias_bomb()}}}\n")
    assert len(text) < 700
    with bounded(), pytest.raises(TargetFileError, match=r"^t\.yaml:3: YAML anchors and aliases are not accepted"):
        parse_target_table(text, "t.yaml")
    table = write(tmp_path, text, "bomb.yaml")
    with bounded(5.0):
        rc, out = run_check(monkeypatch, capsys, env(), str(table))
    assert rc == 2 and shows(f"{table}:3: YAML anchors and aliases", out.err)


@pytest.mark.parametrize("text, line, key, first", [
    ("mode: observe\nstep_interval: 8\nmode: enforce\n", 3, "'mode'", 1),
    ("exchange:\n  timeout_ms: 50\n  timeout_ms: 60000\n", 3, "'timeout_ms'", 2),
    ("hicache: {guard: observe, guard: block}\n", 1, "'guard'", 1),
])
def test_a_key_given_twice_in_the_probe_config_is_refused_with_both_lines(tmp_path, text, line, key, first):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}:{line}: key {key} is given twice in one mapping "
                                                    f"(first at line {first})")):
        load_file(path)


def test_a_key_given_twice_in_a_target_table_is_refused_with_its_line():
    text = ("targets:\n  - name: a\n    module: m\n    qualname: C.f\n    kind: after\n"
            "    hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper'\n    required: true\n    required: false\n"
            "    role: any\n")
    with pytest.raises(TargetFileError, match=re.escape("t.yaml:8: key 'required' is given twice in one mapping "
                                                        "(first at line 7)")):
        parse_target_table(text, "t.yaml")


def test_a_document_past_the_node_bound_is_refused(tmp_path):
    path = write(tmp_path, "targets: [" + ", ".join(["x"] * 10_001) + "]\n")
    with bounded(), pytest.raises(ConfigError, match="more than 10,000 nodes"):
        load_file(path)


def test_a_long_rejected_value_is_shortened_in_the_message(tmp_path):
    path = write(tmp_path, "mode: " + "x" * 200_000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_file(path)
    message = str(info.value)
    assert "must be one of ['observe', 'enforce'], got 'xxxx" in message and "xxx...xxx" in message
    assert len(message) < len(str(path)) + 200


def test_a_date_that_does_not_exist_is_a_named_error(tmp_path):
    path = write(tmp_path, "layout: 2001-13-45\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:1: cannot read '2001-13-45': month must be in 1..12")):
        load_file(path)


def test_shorten_is_bounded_for_any_value():
    from dsv4_idxk_probe.safeyaml import shorten

    shared = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9  # 9**9 strings, shared: a full repr would be GiBs
    with bounded(0.5):
        for value in (10**5000, -(10**5000), "x" * 10**6, shared, {i: shared for i in range(100)}, b"\xff" * 10**6):
            text = shorten(value)
            assert len(text) <= 80, text
    assert shorten(10**5000) == "<an integer of about 5,001 digits>"
    assert shorten("abc") == "'abc'" and shorten([1, "a"]) == "[1, 'a']"
    assert len(shorten("y" * 100)) <= 80 and "yyy...yyy" in shorten("y" * 100)
    assert shorten(list(range(100))).endswith("...]") and len(shorten("z" * 100, 20)) <= 20


# %% 2. numbers: every field has a range, refused without computing with huge values


def _numeric_fields():
    from dsv4_idxk_probe.config import _SECTION_TYPES

    out = [(None, "step_interval")]
    for section, cls in _SECTION_TYPES.items():
        for f in msgspec.structs.fields(cls):
            default = f.default
            if f.name == "port" or (isinstance(default, (int, float)) and not isinstance(default, bool)):
                out.append((section, f.name))
    return out


NUMERIC = _numeric_fields()


def test_the_numeric_fields_are_the_expected_ones():
    assert len(NUMERIC) >= 18 and ("exchange", "backoff_s") in NUMERIC and ("roomlog", "queue_size") in NUMERIC


@pytest.mark.parametrize("section, key", NUMERIC)
@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000, math.inf, -math.inf, math.nan, 1e308],
                         ids=["1e400", "-1e400", "1e5000", "inf", "-inf", "nan", "1e308"])
def test_every_numeric_field_refuses_values_past_its_range(section, key, value):
    document = {key: value} if section is None else {section: {key: value}}
    with bounded(0.5), pytest.raises(ConfigError) as info:
        parse_config(document, "probe.yaml")
    assert len(str(info.value)) < 200, str(info.value)


@pytest.mark.parametrize("section, key", NUMERIC)
def test_every_numeric_field_states_its_range_in_the_docs(section, key):
    name = key if section is None else f"{section}.{key}"
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1 and re.search(r"Range [\[(]?-?\d", rows[0]), rows


@pytest.mark.parametrize("text, message", [
    ("exchange: {backoff_s: 1" + "0" * 400 + "}\n", "probe.yaml:1: a number of 401 characters is out of range"),
    ("exchange: {backoff_s: 1" + "0" * 90 + "}\n", "exchange.backoff_s must be a number of seconds <= 3600"),
    ("roomlog: {queue_size: " + "1" * 5000 + "}\n", "1: a number of 5,000 characters is out of range"),
    ("roomlog: {queue_size: 0x" + "f" * 98 + "}\n", "roomlog.queue_size must be an integer <= 1_000_000"),
    ("metrics: {port: 1" + "0" * 90 + "}\n", "metrics.port must be a port number (0-65535)"),
    ("step_interval: -1" + "0" * 90 + "\n", "step_interval must be an integer >= 0"),
])
def test_huge_numbers_in_the_file_make_check_exit_2_not_3(tmp_path, monkeypatch, capsys, text, message):
    path = write(tmp_path, text)
    rc, out = run_check(monkeypatch, capsys, env(path))
    assert rc == 2, out.err
    assert shows(message, out.err) and "internal error" not in out.err and len(out.err) < 400


@pytest.mark.parametrize("settings, message", [
    ({"flush_interval_s": math.inf}, "hicache.flush_interval_s must be a number of seconds in [0.05, 3600]"),
    ({"flush_interval_s": 1e-300}, "hicache.flush_interval_s must be a number of seconds in [0.05, 3600]"),
    ({"flush_interval_s": 10**400}, "hicache.flush_interval_s must be a number of seconds in [0.05, 3600]"),
    ({"flush_interval_s": math.nan}, "hicache.flush_interval_s must be a number > 0"),
    ({"guard_stack_logs": 10**30}, "hicache.guard_stack_logs must be an integer <= 10_000"),
    pytest.param({"index_queue_max": 10**5000}, "hicache.index_queue_max must be an integer <= 1_000_000",
                 id="index_queue_max-1e5000"),
    ({"roundtrip_max_entries": 10**12}, "hicache.roundtrip_max_entries must be an integer <= 100_000_000"),
    ({"io_backends": ["kernel"] * 1000}, "hicache.io_backends must list at most 16 backends"),
    ({"io_backends": ["k" * 10_000]}, "hicache.io_backends[0] must be a string of 1-64 characters"),
])
def test_the_hicache_section_has_bounds(settings, message):
    with bounded(0.5), pytest.raises(ConfigError) as info:
        parse_config({"hicache": settings}, "probe.yaml")
    assert message in str(info.value) and len(str(info.value)) < 250


def test_the_hicache_bounds_are_inclusive_and_documented():
    config = parse_config({"hicache": {"flush_interval_s": 0.05, "guard_stack_logs": 10_000, "index_queue_max": 1,
                                       "roundtrip_max_entries": 100_000_000}}, "probe.yaml")
    assert config.hicache["flush_interval_s"] == 0.05
    text = DOCS.read_text()
    for key in ("guard_stack_logs", "flush_interval_s", "index_queue_max", "roundtrip_max_entries"):
        rows = [line for line in text.splitlines() if line.startswith(f"| `hicache.{key}` |")]
        assert len(rows) == 1 and "Range" in rows[0], key


# %% 3. the exchange secret file's permissions


def secret_file(tmp_path, mode):
    path = tmp_path / "exchange.secret"
    path.write_text("0123456789abcdef-cluster-secret\n")
    path.chmod(mode)
    return path


def test_a_secret_others_may_read_is_accepted_with_a_warning(tmp_path, caplog, monkeypatch, capsys):
    path = secret_file(tmp_path, 0o644)
    with caplog.at_level(logging.WARNING, logger="dsv4_idxk_probe"):
        config = load_config(env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(path)))
    assert config.exchange.secret_file == str(path)
    assert f"{path}: the exchange secret is readable by users other than its owner (mode 0644)" in caplog.text
    rc, out = run_check(monkeypatch, capsys, env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(path)))
    assert rc == 0, out.err
    assert shows(f"warning: exchange.secret_file: {path}: the exchange secret is readable by users other than its "
                 "owner (mode 0644); chmod 600 it", out.out)


def test_a_secret_only_its_owner_may_read_gives_no_warning(tmp_path, caplog, monkeypatch, capsys):
    path = secret_file(tmp_path, 0o600)
    with caplog.at_level(logging.WARNING, logger="dsv4_idxk_probe"):
        load_config(env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(path)))
    assert "exchange secret" not in caplog.text
    rc, out = run_check(monkeypatch, capsys, env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(path)))
    assert rc == 0 and "exchange secret" not in out.out  # (a relative room-log dir has its own warning)


@pytest.mark.parametrize("mode", [0o666, 0o602])
def test_a_secret_every_user_may_write_is_refused(tmp_path, monkeypatch, capsys, mode):
    path = secret_file(tmp_path, mode)
    # named where it came from: the variable (it read "<defaults>: exchange.secret_file", or the
    # config file's name though that file has no such key)
    with pytest.raises(ConfigError, match=re.escape(f"environment: DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE: {path}: "
                                                    f"the exchange secret is writable by every user (mode {mode:04o})")):
        load_config(env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(path)))
    rc, out = run_check(monkeypatch, capsys, env(DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE=str(path)))
    assert rc == 2 and "writable by every user" in out.err


# %% 4. a table's hook names only the probe's own wrapper factories


ENTRY = ("targets:\n  - name: evil\n    module: sglang.srt.disaggregation.prefill\n"
         "    qualname: PrefillBootstrapQueue._init_kv_manager\n    params: [self]\n    kind: after\n"
         "    hook: {hook!r}\n    required: true\n    role: prefill\n")


@pytest.mark.parametrize("hook", [
    "sys:exit", "os:system", "builtins:exec", "dsv4_idxk_probe.config:load_config",
    "dsv4_idxk_probe.sglang.targets:select_table", "dsv4_idxk_probe.sglangx.mod:make_x_wrapper",
    "dsv4_idxk_probe.sglang.pd_prefill:make_queue_init_wrapper.__globals__", "dsv4_idxk_probe.sglang..x:make_x_wrapper",
])
def test_a_hook_outside_the_probe_is_refused_at_load_naming_file_and_line(hook):
    with pytest.raises(TargetFileError, match=re.escape(f"t.yaml:2: targets[0] (evil).hook: {hook!r} is not one of "
                                                        "the probe's wrapper factories")):
        parse_target_table(ENTRY.format(hook=hook), "t.yaml")


def test_check_exits_2_for_a_table_naming_sys_exit(tmp_path, monkeypatch, capsys):
    table = write(tmp_path, ENTRY.format(hook="sys:exit"), "evil.yaml")
    rc, out = run_check(monkeypatch, capsys, env(), str(table))
    assert rc == 2 and shows(f"{table}:2: targets[0] (evil).hook: 'sys:exit' is not one of", out.err)


def test_a_hook_of_the_probe_is_accepted():
    (target,) = parse_target_table(ENTRY.format(hook="dsv4_idxk_probe.sglang.pd_prefill:make_queue_init_wrapper"),
                                   "t.yaml")
    assert target.hook == "dsv4_idxk_probe.sglang.pd_prefill:make_queue_init_wrapper"


# The guard around a hook (a Target built in Python code is not checked against the
# allowlist: these stand for a probe bug that calls sys.exit).


class Host:
    def step(self, x):
        if x < 0:
            raise SystemExit(3)  # SGLang's own exit: it must pass through
        return x + 1


def make_exit_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        raise SystemExit(1)

    return wrapper


def make_exit_after_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        raise SystemExit(1)

    return wrapper


def make_interrupt_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        raise KeyboardInterrupt

    return wrapper


@contextmanager
def patched(hook):
    from dsv4_idxk_probe.sglang.patcher import Patcher

    statuses = {}
    runtime = SimpleNamespace(enabled=True,
                              set_target_status=lambda name, status, required: statuses.update({name: status}))
    target = Target("t.step", __name__, "Host.step", ("self", "x"), "around", hook, True, "any", "test")
    patcher = Patcher(runtime, [target], route="wrapt")
    patcher.patch()
    try:
        assert isinstance(Host.__dict__["step"], wrapt.FunctionWrapper)
        yield statuses
    finally:
        patcher.unpatch()


@pytest.mark.parametrize("hook, site", [
    ("sys:exit", "factory.t.step"),  # the factory itself raises SystemExit(runtime)
    (f"{__name__}:make_exit_wrapper", "hook.t.step"),  # the hook raises before the original
    (f"{__name__}:make_exit_after_wrapper", "hook.t.step"),  # ... after it returned
])
def test_a_system_exit_from_the_probe_never_reaches_the_host(hook, site):
    before = safety.error_counts().get(site, 0)
    with patched(hook):
        assert Host().step(1) == 2
        assert Host().step(5) == 6
    assert safety.error_counts().get(site, 0) > before


def test_the_hosts_own_system_exit_and_a_keyboard_interrupt_pass_through():
    with patched(f"{__name__}:make_exit_after_wrapper"):
        with pytest.raises(SystemExit) as info:
            Host().step(-1)
        assert info.value.code == 3
    with patched(f"{__name__}:make_interrupt_wrapper"):
        with pytest.raises(KeyboardInterrupt):
            Host().step(1)
