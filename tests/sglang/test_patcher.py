"""Patcher: apply, guard, verify and remove hooks (a plain host module, plus
SGLang's real HookRegistry for the plugin route)."""

from __future__ import annotations

import sys
import textwrap

import patch_fixture_host as host
import pytest
import wrapt
from pd_testkit import make_runtime

from dsv4_idxk_probe import safety
from dsv4_idxk_probe.sglang.patcher import PATCHED_FLAG, Patcher
from dsv4_idxk_probe.sglang.targets import Target

MODULE = host.__name__


def target(name, qualname, factory, params=("self", "x"), required=True, module=MODULE):
    return Target(name, module, qualname, tuple(params), "around", f"{MODULE}:{factory}", required, "any", "test")


TABLE = [
    target("t.add", "Host.add", "make_counting_wrapper", ("self", "x", "y")),
    target("t.scale", "Host.scale", "make_raise_before_wrapper"),
    target("t.negate", "Host.negate", "make_raise_after_wrapper"),
    target("t.explode", "Host.explode", "make_counting_wrapper"),
    target("t.square", "Host.square", "make_broken_factory"),
]


@pytest.fixture
def patched():
    runtime, sink, registry = make_runtime()
    patcher = Patcher(runtime, TABLE, route="wrapt")
    runtime.patcher = patcher
    patcher.patch()
    host.calls.clear()
    yield runtime, patcher, registry
    patcher.unpatch()
    runtime.close()


def errors(site):
    return safety.error_counts().get(site, 0)


def test_wrapped_method_runs_through_the_hook(patched):
    assert host.Host().add(2, y=3) == 5
    assert host.calls == [("Host", (2,))]
    assert isinstance(host.Host.__dict__["add"], wrapt.FunctionWrapper)


@pytest.mark.parametrize("method, arg, expected, site", [
    ("scale", 4, 8, "hook.t.scale"),  # the hook raises before calling the original
    ("negate", 4, -4, "hook.t.negate"),  # ... after the original returned
    ("square", 4, 16, "factory.t.square"),  # the factory itself raises
])
def test_raising_hook_leaves_the_result_intact(patched, method, arg, expected, site):
    runtime, patcher, registry = patched
    before = errors(site)
    assert getattr(host.Host(), method)(arg) == expected
    assert getattr(host.Host(), method)(arg) == expected
    assert errors(site) - before in (1, 2)  # counted (the factory fails once, then stays off)
    from dsv4_idxk_probe.metrics.definitions import error_component, process_labels

    labels = {**process_labels({}), "component": error_component(site)}
    assert runtime.metrics is not None  # created after the failures: they are replayed into it
    assert registry.get_sample_value("dsv4_idxk_probe_errors_total", labels) == errors(site) - before


def test_factory_failure_marks_the_target(patched):
    runtime, patcher, _ = patched
    host.Host().square(3)
    assert patcher.status["t.square"][0] == "hook_error"


def test_host_exception_passes_through_unchanged(patched):
    with pytest.raises(ValueError, match="host failure 7"):
        host.Host().explode(7)
    assert host.calls == [("Host", (7,))]


def test_original_runs_once_when_the_hook_fails_after_it(patched):
    assert host.Host().negate(5) == -5
    assert host.calls == [("negate", 5)]


def test_missing_or_changed_targets_are_reported_not_fatal():
    runtime, _, _ = make_runtime()
    table = [
        target("t.add", "Host.add", "make_counting_wrapper", ("self", "x", "y")),
        target("t.gone_module", "Host.add", "make_counting_wrapper", module="no_such_module_here"),
        target("t.gone_attr", "Host.nothing", "make_counting_wrapper"),
        target("t.changed", "Host.scale", "make_counting_wrapper", ("self", "x", "ratio")),
    ]
    patcher = Patcher(runtime, table, route="wrapt")
    try:
        patcher.patch()
        patcher.verify()  # what scheduler start does: a module that never loads is looked for
        status = {name: s for name, (s, _) in patcher.status.items()}
        assert status == {"t.add": "patched", "t.gone_module": "missing", "t.gone_attr": "missing", "t.changed": "signature_changed"}
        assert "found ['self', 'x', 'factor']" in patcher.status["t.changed"][1]
        host.calls.clear()
        assert host.Host().add(1) == 2 and host.calls  # the good target works
    finally:
        patcher.unpatch()
        runtime.close()


def test_patch_twice_does_not_double_wrap(patched):
    runtime, patcher, _ = patched
    second = Patcher(runtime, TABLE[:1], route="wrapt")
    second.patch()
    assert second.status["t.add"][0] == "not_applied"
    wrapper = host.Host.__dict__["add"]
    assert not isinstance(wrapper.__wrapped__, wrapt.ObjectProxy)
    assert patcher.verify()["t.add"][0] == "patched"


def test_unpatch_restores_and_patch_again_works():
    runtime, _, _ = make_runtime()
    original = host.Host.__dict__["add"]
    for _ in range(2):
        patcher = Patcher(runtime, TABLE[:1], route="wrapt")
        patcher.patch()
        assert isinstance(host.Host.__dict__["add"], wrapt.FunctionWrapper)
        assert "Host.add" in getattr(host, PATCHED_FLAG)
        patcher.unpatch()
        patcher.unpatch()  # idempotent
        assert host.Host.__dict__["add"] is original
        assert not hasattr(host, PATCHED_FLAG)
    runtime.close()


def test_disabled_runtime_calls_straight_through(patched):
    runtime, _, _ = patched
    runtime.enabled = False
    assert host.Host().add(1) == 2
    assert host.calls == []


def test_target_imported_later_is_patched_on_import(tmp_path, monkeypatch):
    (tmp_path / "late_host_module.py").write_text(textwrap.dedent("""
        class Late:
            def add(self, x, y=1):
                return x + y
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime, _, _ = make_runtime()
    late = Target("t.late", "late_host_module", "Late.add", ("self", "x"), "around",
                  f"{MODULE}:make_counting_wrapper", True, "any", "test")
    patcher = Patcher(runtime, [late], route="wrapt")
    try:
        assert patcher.patch()["t.late"][0] == "pending"
        import late_host_module

        assert patcher.status["t.late"][0] == "patched"
        host.calls.clear()
        assert late_host_module.Late().add(1) == 2 and host.calls == [("Late", (1,))]
    finally:
        patcher.unpatch()
        runtime.close()
        sys.modules.pop("late_host_module", None)


# %% SGLang's plugin route


@pytest.fixture
def loader_context():
    """What SGLang's load_plugins() sets around a plugin's function."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, _current_plugin_source

    token = _current_plugin_source.set(HookSource("dsv4_idxk_probe", "dsv4-idxk-probe"))
    yield HookRegistry
    _current_plugin_source.reset(token)
    HookRegistry.reset()


def test_registry_route_is_applied_and_verified(loader_context):
    registry = loader_context
    runtime, _, _ = make_runtime()
    original = host.Host.__dict__["add"]
    patcher = Patcher(runtime, TABLE[:1])
    try:
        assert patcher.patch()["t.add"][0] == "pending"
        assert host.Host.__dict__["add"] is original  # the registry applies after all plugins ran
        registry.apply_hooks()
        host.calls.clear()
        assert host.Host().add(2) == 3  # first call verifies
        assert patcher.status["t.add"][0] == "patched"
        assert host.calls == [("Host", (2,))]
    finally:
        patcher.unpatch()
        runtime.close()
    assert host.Host.__dict__["add"] is original


def test_registry_that_did_not_apply_is_reported(loader_context):
    registry = loader_context
    runtime, _, _ = make_runtime()
    patcher = Patcher(runtime, TABLE[:1])
    try:
        patcher.patch()
        registry._hooks.clear()  # as if the registry failed on this target (it only logs)
        registry.apply_hooks()
        assert patcher.verify()["t.add"] == ("not_applied", f"{MODULE}.Host.add is not wrapped after patching")
    finally:
        patcher.unpatch()
        runtime.close()


def test_registry_route_patches_again_after_an_unpatch(loader_context):
    """Uninstall takes the target out of SGLang's registry too (its `_patched` set), so a
    second install in the same process hooks the target again."""
    registry = loader_context
    for cycle in range(2):
        runtime, _, _ = make_runtime()
        patcher = Patcher(runtime, TABLE[:1])
        try:
            patcher.patch()
            registry.apply_hooks()
            host.calls.clear()
            assert host.Host().add(2) == 3
            assert host.calls == [("Host", (2,))], cycle
            assert patcher.status["t.add"][0] == "patched", cycle
        finally:
            patcher.unpatch()
            runtime.close()
        assert f"{MODULE}.Host.add" not in registry._patched


def test_targets_naming_one_function_in_several_modules_share_one_registry_hook(loader_context, tmp_path,
                                                                                monkeypatch):
    """SGLang's registry rebinds every module holding a patched function (`from X import f`
    copies) to its wrapper: targets that name the same function in several modules with the
    same hook (the table's four `release_kv_cache`) register it once, each call runs the hook
    once, every module is verified, and uninstall puts the original back in every module."""
    registry = loader_context
    (tmp_path / "shared_fn_home.py").write_text("def release(x):\n    return x + 1\n")
    (tmp_path / "shared_fn_user.py").write_text("from shared_fn_home import release\n")
    (tmp_path / "shared_fn_bystander.py").write_text("from shared_fn_home import release\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import shared_fn_bystander
    import shared_fn_home
    import shared_fn_user

    original = shared_fn_home.release
    targets = [Target(f"t.{m}", m, "release", ("x",), "around", f"{MODULE}:make_counting_wrapper", True, "any", "test")
               for m in ("shared_fn_home", "shared_fn_user")]
    runtime, _, _ = make_runtime()
    patcher = Patcher(runtime, targets)
    try:
        patcher.patch()
        registry.apply_hooks()
        host.calls.clear()
        assert shared_fn_user.release(1) == 2
        assert host.calls == [("NoneType", (1,))]  # once, not once per target
        assert {name: s[0] for name, s in patcher.verify().items()} == {
            "t.shared_fn_home": "patched", "t.shared_fn_user": "patched"}
    finally:
        patcher.unpatch()
        runtime.close()
        for m in ("shared_fn_home", "shared_fn_user", "shared_fn_bystander"):
            sys.modules.pop(m, None)
    assert shared_fn_home.release is original and shared_fn_user.release is original
    assert shared_fn_bystander.release is original  # a module the table never named, rebound by SGLang


def test_a_check_of_the_hooks_that_fails_at_the_first_call_leaves_sglang_s_call_alone(loader_context, tmp_path,
                                                                                       monkeypatch):
    """The registry route checks its hooks at the first hooked call; a check that raises (here
    the target's module has gone from sys.modules) is the probe's failure, counted, and the
    call runs and returns as it would have."""
    registry = loader_context
    (tmp_path / "verify_host.py").write_text("class Box:\n    def add(self, x, y=1):\n        return x + y\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import verify_host

    box = Target("t.box", "verify_host", "Box.add", ("self", "x"), "around", f"{MODULE}:make_counting_wrapper",
                 True, "any", "test")
    runtime, _, _ = make_runtime()
    patcher = Patcher(runtime, [box])
    try:
        patcher.patch()
        registry.apply_hooks()
        del sys.modules["verify_host"]
        before = errors("patch.verify")
        assert verify_host.Box().add(2) == 3
        assert errors("patch.verify") == before + 1
        assert verify_host.Box().add(3) == 4  # checked once: not again at every call
        assert errors("patch.verify") == before + 1
    finally:
        sys.modules["verify_host"] = verify_host
        patcher.unpatch()
        runtime.close()
        sys.modules.pop("verify_host", None)
