"""Target tables against the installed sglang==0.5.23, the table format, and `check`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

import sglang.srt.disaggregation as disaggregation
from dsv4_idxk_probe.cli import check
from dsv4_idxk_probe.sglang.targets import (
    TargetFileError, installed_sglang, load_factory, load_target_file, load_targets, parse_target_table, resolve,
    release_tuple, select_table, shipped_target_path,
)

FORK_FIXTURE = Path(__file__).resolve().parent / "fork_fixture"


def test_every_shipped_target_resolves_with_its_signature():
    targets = load_target_file("sglang")
    names = {t.name for t in targets}
    assert names >= {"pd.send_kv_chunk", "pd.sender_send", "pd.commit_transfer", "hicache.pool_init"}
    assert len(names & {"pd.send_kv_metadata", "pd.preallocated"}) == 1  # one way to learn decode's pages
    for target in targets:
        resolution = resolve(target)
        assert resolution.ok, f"{target.name}: {resolution.status}: {resolution.detail}"
        assert callable(load_factory(target)), target.hook


@pytest.fixture
def fork_package(monkeypatch):
    """`sglang.srt.disaggregation.prefill2` / `decode2`: the upstream classes under fork names."""
    monkeypatch.setattr(disaggregation, "__path__", [*disaggregation.__path__, str(FORK_FIXTURE)])
    yield
    for name in ("sglang.srt.disaggregation.prefill2", "sglang.srt.disaggregation.decode2"):
        sys.modules.pop(name, None)


def test_fork_table_resolves_against_the_fork_layout(fork_package):
    targets = load_target_file("fork-prefill2-decode2")
    modules = {t.module for t in targets}
    assert {"sglang.srt.disaggregation.prefill2", "sglang.srt.disaggregation.decode2"} <= modules
    assert not any(m in ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode") for m in modules)
    for target in targets:
        resolution = resolve(target)
        assert resolution.ok, f"{target.name}: {resolution.detail}"


def test_the_fork_table_hooks_each_target_as_the_upstream_table_does():
    """The tables differ in module names only (the fork leaves HiCache out): `check` showed
    the fork's `pd.send_kv_metadata` as an after hook, which it is not."""
    upstream = {t.name: (t.qualname, t.kind, t.hook) for t in load_target_file("sglang")}
    fork = {t.name: (t.qualname, t.kind, t.hook) for t in load_target_file("fork-prefill2-decode2")}
    assert fork and {name: upstream.get(name) for name in fork} == fork


@pytest.mark.parametrize("where", ["tables@prod/fork.yaml", "fork.yml"])
def test_a_table_path_with_an_at_sign_or_a_yml_suffix_is_read_as_that_path(tmp_path, monkeypatch, where):
    """An @ in a folder's name was read as a release ("tables" read, not found), and a `.yml`
    file as a shipped table's name: the probe stayed off."""
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(shipped_target_path("sglang").read_text())
    monkeypatch.chdir(tmp_path)
    assert {t.name for t in load_target_file(where)} == {t.name for t in load_target_file("sglang")}
    if where == "fork.yml":
        return
    config = path.parent / "probe.yaml"  # a config in that folder naming the table relative to it
    config.write_text("targets: [fork.yaml]\n")
    from dsv4_idxk_probe.config import load_file

    assert load_file(str(config)).targets == (str(path),)


def test_a_table_name_that_is_not_shipped_is_named_with_the_names_that_are():
    """A typo named a file inside the installed package, which no operator wrote."""
    with pytest.raises(TargetFileError) as err:
        load_target_file("fork-prefill2-decode")
    assert str(err.value) == ("targets: 'fork-prefill2-decode' is neither a shipped table (fork-prefill2-decode2, "
                              "sglang) nor a path (a path has a / or ends in .yaml or .yml)")


def test_fork_table_reports_missing_modules_without_the_fork():
    targets = [t for t in load_target_file("fork-prefill2-decode2") if t.module.endswith("prefill2")]
    assert targets and all(resolve(t).status == "missing" for t in targets)


def test_changed_signature_is_reported_with_both_parameter_lists():
    (target,) = parse_target_table(
        """
targets:
  - name: x.send
    module: sglang.srt.disaggregation.common.conn
    qualname: CommonKVSender.send
    params: [self, kv_indices, notif]
    kind: before
    hook: "dsv4_idxk_probe.sglang.pd_prefill:make_sender_send_wrapper"
    required: true
    role: prefill
""",
        "t.yaml",
    )
    resolution = resolve(target)
    assert resolution.status == "signature_changed"
    assert "expected leading parameters ['self', 'kv_indices', 'notif']" in resolution.detail
    assert "['self', 'kv_indices', 'state_indices']" in resolution.detail


@pytest.mark.parametrize("entry, message", [
    ("  - {name: a, module: m, qualname: C.f, kind: sideways, hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', required: true, role: any}",
     "t.yaml:3: targets[0] (a).kind must be one of ['before', 'after', 'around'], got 'sideways'"),
    ("  - {name: a, module: m, qualname: C.f, kind: after, hook: 'p.f', required: true, role: any}",
     "t.yaml:3: targets[0] (a).hook must be 'package.module:factory'"),
    ("  - {name: a, module: m, qualname: C.f, kind: after, hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', required: yes please, role: any}",
     "t.yaml:3: targets[0] (a).required must be true or false"),
    ("  - {name: a, module: m, qualname: C.f, kind: after, hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', required: true, role: any, colour: red}",
     "t.yaml:3: targets[0] (a) has unknown field(s) ['colour']"),
    ("  - {name: a, qualname: C.f, kind: after, hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', required: true, role: any}",
     "t.yaml:3: targets[0] (a).module must be a non-empty string"),
    # a hook names only the probe's own wrapper factories (reliability round two)
    ("  - {name: a, module: m, qualname: C.f, kind: after, hook: 'sys:exit', required: true, role: any}",
     "t.yaml:3: targets[0] (a).hook: 'sys:exit' is not one of the probe's wrapper factories"),
    ("  - {name: a, module: m, qualname: C.f, kind: after, hook: 'dsv4_idxk_probe.cli.main:run', required: true,"
     " role: any}",
     "t.yaml:3: targets[0] (a).hook: 'dsv4_idxk_probe.cli.main:run' is not one of the probe's wrapper factories"),
    ("  - {name: a, module: m, qualname: C.f, kind: after, hook: 'p:f', required: true, role: any, role: decode}",
     "t.yaml:3: key 'role' is given twice in one mapping (first at line 3)"),
])
def test_bad_table_names_file_line_and_field(entry, message):
    with pytest.raises(TargetFileError) as info:
        parse_target_table(f"# header\ntargets:\n{entry}\n", "t.yaml")
    assert message in str(info.value)


@pytest.mark.parametrize("body", ["targets: []\n", "targets:\n"])
def test_a_table_of_no_targets_is_refused(body):
    """It patched nothing, and `check --targets` passed it (found by review)."""
    with pytest.raises(TargetFileError, match="t.yaml:1: targets must be a non-empty list"):
        parse_target_table(body, "t.yaml")


@pytest.mark.parametrize("name", ["sglang", "fork-prefill2-decode2"])
def test_every_shipped_hook_is_one_the_allowlist_accepts(name):
    from dsv4_idxk_probe.sglang.targets import hook_problem, read_table, shipped_target_path

    table = read_table(shipped_target_path(name))
    assert table.targets and [t.hook for t in table.targets if hook_problem(t.hook)] == []


def test_duplicate_target_names_across_tables_are_refused(tmp_path):
    for name in ("one", "two"):
        (tmp_path / f"{name}.yaml").write_text(
            "targets:\n  - {name: dup, module: m, qualname: C.f, kind: after, hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', required: false, role: any}\n"
        )
    with pytest.raises(TargetFileError, match="target name 'dup' also defined at"):
        load_targets([str(tmp_path / "one.yaml"), str(tmp_path / "two.yaml")])


def test_a_target_path_that_is_no_small_regular_file_is_refused_unread(tmp_path):
    """An operator may name any path: a FIFO must not hang the reader, a device or a
    huge file must not be read whole."""
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(TargetFileError, match="fifo.yaml: cannot read target file: not a regular file"):
        load_target_file(str(fifo))
    with pytest.raises(TargetFileError, match="/dev/zero: cannot read target file: not a regular file"):
        load_target_file("/dev/zero")
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate((1 << 20) + 1)
    with pytest.raises(TargetFileError, match="big.yaml: target file is 1,048,577 bytes, over the"):
        load_target_file(str(big))
    (tmp_path / "latin.yaml").write_bytes(b"targets: [\xff]\n")
    with pytest.raises(TargetFileError, match="latin.yaml: target file is not UTF-8 text"):
        load_target_file(str(tmp_path / "latin.yaml"))


def _check(capsys, *targets):
    rc = check.main(argparse.Namespace(targets=list(targets) or None, json=False))
    return rc, capsys.readouterr()


def test_check_passes_on_the_installed_sglang(capsys, monkeypatch):
    monkeypatch.delenv("DSV4_IDXK_PROBE_CONFIG", raising=False)
    rc, out = _check(capsys)
    assert rc == 0, out.out
    release = installed_sglang()
    targets = load_target_file("sglang")
    assert f"SGLang {release} detected" in out.out and f"table sglang@{release} chosen" in out.out
    assert f"{len(targets)}/{len(targets)} targets resolve; 0 required target(s) missing" in out.out
    assert out.out.count("\nok ") == len(targets)
    optional = [t for t in targets if not t.required]
    assert optional and all(t.cost for t in optional)  # every optional target says what it costs
    assert out.out.count("  if missing: ") == len(optional)
    said = " ".join(out.out.split())  # entries are wrapped at 100 columns
    for t in optional:
        assert f"if missing: {' '.join(t.cost.split())}" in said


def test_check_fails_when_a_required_target_is_missing(tmp_path, capsys):
    table = tmp_path / "t.yaml"
    table.write_text(
        "targets:\n"
        "  - {name: gone, module: sglang.srt.disaggregation.prefill, qualname: Nope.send, kind: after,"
        " hook: 'dsv4_idxk_probe.sglang.pd_prefill:make_queue_init_wrapper', required: true, role: prefill}\n"
        "  - {name: here, module: sglang.srt.disaggregation.prefill, qualname: PrefillBootstrapQueue._init_kv_manager,"
        " params: [self], kind: after, hook: 'dsv4_idxk_probe.sglang.pd_prefill:make_queue_init_wrapper',"
        " required: true, role: prefill}\n"
    )
    rc, out = _check(capsys, str(table))
    assert rc == 1
    assert "missing" in out.out and "Nope.send not found" in out.out
    assert "1 required target(s) missing or changed" in out.out


def test_check_rejects_an_invalid_table_with_exit_2(tmp_path, capsys):
    table = tmp_path / "bad.yaml"
    table.write_text("targets:\n  - {name: x}\n")
    rc, out = _check(capsys, str(table))
    assert rc == 2 and f"{table}:2: targets[0] (x).module must be a non-empty string" in " ".join(out.err.split())
