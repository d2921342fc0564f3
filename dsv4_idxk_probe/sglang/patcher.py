"""Apply the target table's hooks to SGLang, and take them off again.

One `Patcher` per runtime drives wrapping, verification and unwrapping from
the same table (configs/targets/*.yaml):

* a target whose module is already imported is applied now; one whose module
  is not is applied when it is first imported (wrapt post-import hook), so a
  process that never loads the module never pays for it;
* inside SGLang's plugin loader (0.5.23+) hooks are registered with its
  ``HookRegistry`` as AROUND hooks; the registry applies them after every
  plugin has run and only logs a failure, so `verify()` checks each one really
  wrapped its target (run at scheduler start and on the first hook call);
* elsewhere (the ``.pth`` route, tests, forks) `wrapt.wrap_function_wrapper`
  applies the same wrappers;
* each wrapper is built lazily, on its first call, by the factory named in
  the table, and runs inside a guard: an exception from the probe is counted,
  logged once, and the original method runs and returns as without the probe.
  SGLang's own exceptions pass through unchanged.

What the guard contains: every `BaseException` the probe raises except
`KeyboardInterrupt`. A `SystemExit` (a factory or hook calling ``sys.exit``),
`GeneratorExit` or any other non-`Exception` from probe code is a probe
failure like any other and must not end or unwind SGLang's call: counted,
logged, the original runs. `KeyboardInterrupt` is the one exception that is
not the probe's doing: the signal lands on whatever frame the main thread is
in, the probe's included, and swallowing it there would eat the operator's
Ctrl-C (and re-run the original after it), so it always propagates. An
exception raised by SGLang's original method inside the hook (``SystemExit``
included) is SGLang's and passes through unchanged, as does a refusal the
config asked for (the HiCache guard in block mode).

Idempotence: a registry keyed by (target, attribute) and a
``_dsv4_idxk_probe_patched`` set of qualnames on each patched module, filled
before wrapping so a re-entrant import cannot patch twice.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterable

from ..safety import record_error
from .targets import Resolution, Target, load_factory, resolve

log = logging.getLogger("dsv4_idxk_probe.patch")

PATCHED_FLAG = "_dsv4_idxk_probe_patched"
ADAPTER_MARK = "_dsv4_idxk_probe_target"


def _intended_exceptions() -> tuple[type, ...]:
    """Exceptions a hook raises on purpose (hicache guard in block mode)."""
    try:
        from ..hicache.probe import GuardRefused
    except Exception:
        return ()
    return (GuardRefused,)


class _Call:
    __slots__ = ("called", "returned", "result")

    def __init__(self):
        self.called = self.returned = False
        self.result = None


class GuardedHook:
    """The wrapt-style wrapper installed on a target: builds the factory's
    wrapper on first use and keeps SGLang's behaviour if the probe fails."""

    def __init__(self, patcher: "Patcher", target: Target):
        self.patcher = patcher
        self.target = target
        self.site = f"hook.{target.name}"
        self._hook = None
        self._broken = False
        self._lock = threading.Lock()

    def _build(self):
        with self._lock:
            if self._hook is None and not self._broken:
                try:
                    self._hook = load_factory(self.target)(self.patcher.runtime)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # SystemExit included: a factory never ends SGLang's call (module doc)
                    self._broken = True
                    record_error(f"factory.{self.target.name}")
                    self.patcher.set_status(self.target, "hook_error", "factory raised (see log)")
            return self._hook

    def __call__(self, wrapped, instance, args, kwargs):
        runtime = self.patcher.runtime
        if not runtime.enabled or self._broken:
            return wrapped(*args, **kwargs)
        if not self.patcher.verified:
            try:
                self.patcher.verify()
            except Exception:  # a failed check of the hooks is the probe's, never SGLang's call's
                record_error("patch.verify")
        hook = self._hook or self._build()
        if hook is None:
            return wrapped(*args, **kwargs)
        call = _Call()

        def original(*a, **k):
            call.called = True
            result = wrapped(*a, **k)
            call.returned, call.result = True, result
            return result

        try:
            return hook(original, instance, args, kwargs)
        except KeyboardInterrupt:
            raise  # the operator's, wherever it landed (module doc)
        except BaseException as exc:  # SystemExit and the like from the probe are contained too
            if call.returned:  # the probe failed after SGLang's method returned: keep its result
                record_error(self.site)
                return call.result
            if call.called or isinstance(exc, _intended_exceptions()):
                raise  # SGLang's own exception, or a refusal the config asked for
            record_error(self.site)
            return wrapped(*args, **kwargs)


def _registry_adapter(hook: GuardedHook):
    """HookRegistry AROUND form ``fn(original_fn, *args, **kwargs)`` of a wrapt wrapper."""

    def around(original_fn, *args, **kwargs):
        if "." not in hook.target.qualname:  # a module-level function: nothing to bind
            return hook(original_fn, None, args, kwargs)
        if not args:
            return original_fn(*args, **kwargs)
        instance = args[0]
        return hook(original_fn.__get__(instance, type(instance)), instance, args[1:], kwargs)

    setattr(around, ADAPTER_MARK, hook.target.name)
    return around


def _chain_holds(obj: Any, adapter: Any, limit: int = 32) -> bool:
    """Does the ``__wrapped__`` chain from `obj` contain a closure over `adapter`?"""
    for _ in range(limit):
        if obj is None:
            return False
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is adapter:
                    return True
            except ValueError:  # empty cell
                continue
        obj = getattr(obj, "__wrapped__", None)
    return False


def _owner_entry(target: Target) -> Any:
    """The raw class/module dictionary entry the target names (what a patch replaces)."""
    owner = sys.modules[target.module]
    *path, attribute = target.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return getattr(owner, "__dict__", {}).get(attribute)


def _rebind(wrapper: Any, original: Any) -> None:
    """Every module attribute that holds `wrapper` holds `original` again (the undoing of
    SGLang's `_propagate_patch`, which rebinds `from X import f` copies of a patched f)."""
    for module in list(sys.modules.values()):
        try:
            names = [name for name, value in vars(module).items() if value is wrapper]
        except TypeError:
            continue
        for name in names:
            try:
                setattr(module, name, original)
            except (AttributeError, TypeError):
                pass


def _registry():
    """SGLang's HookRegistry when we run inside its plugin loader, else None."""
    module = sys.modules.get("sglang.srt.plugins.hook_registry")
    if module is None:
        return None
    source = getattr(module, "_current_plugin_source", None)
    if source is None or source.get() is None:
        return None
    return module


@dataclass
class Applied:
    target: Target
    route: str  # "wrapt" | "registry"
    resolution: Resolution
    handle: Any  # wrapt FunctionWrapper, or the registry adapter
    shared: bool = False  # registry: the hook another target registered on the same function serves it


class Patcher:
    def __init__(self, runtime: Any, targets: Iterable[Target], *, route: str = "auto"):
        if route not in ("auto", "wrapt", "registry"):
            raise ValueError(f"route must be auto, wrapt or registry, got {route!r}")
        self.runtime = runtime
        self.targets = list(targets)
        self.route = route
        self.status: dict[str, tuple[str, str]] = {}
        self.applied: dict[tuple[str, str], Applied] = {}
        self.verified = True
        self._active = False
        self._lock = threading.RLock()

    # %% status

    def set_status(self, target: Target, status: str, detail: str = "") -> None:
        previous = self.status.get(target.name)
        self.status[target.name] = (status, detail)
        if previous != (status, detail):
            level = logging.INFO if status in ("patched", "pending") else (
                logging.ERROR if target.required else logging.WARNING
            )
            log.log(level, "dsv4-idxk-probe target %s (%s): %s%s", target.name, target.path, status,
                    f" - {detail}" if detail else "")
        self.runtime.set_target_status(target.name, status, target.required)

    # %% patch

    def patch(self) -> dict[str, tuple[str, str]]:
        """Apply (or defer until import) every target; returns name -> (status, detail)."""
        import wrapt

        with self._lock:
            self._active = True
            for target in self.targets:
                if target.module in sys.modules:
                    self._apply(target)
                else:
                    self.set_status(target, "pending", f"applied when {target.module} is imported")
                    wrapt.register_post_import_hook(lambda _m, t=target: self._apply(t), target.module)
            return dict(self.status)

    def _apply(self, target: Target) -> None:
        with self._lock:
            if not self._active or (target.module, target.qualname) in self.applied:
                return
            try:
                self._apply_one(target)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # runs inside SGLang's import of the target module
                record_error("patch.apply")
                self.set_status(target, "not_applied", f"{type(exc).__name__}: {exc}")

    def _apply_one(self, target: Target) -> None:
        import wrapt

        resolution = resolve(target)
        if not resolution.ok:
            self.set_status(target, resolution.status, resolution.detail)
            return
        try:
            load_factory(target)  # import only; the factory runs on first call
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a module that raises SystemExit at import included
            self.set_status(target, "hook_error", f"hook {target.hook} cannot be loaded: {exc}")
            return
        module = sys.modules[target.module]
        flag = getattr(module, PATCHED_FLAG, None)
        if flag is None:
            flag = set()
            setattr(module, PATCHED_FLAG, flag)
        if target.qualname in flag:
            self.set_status(target, "not_applied", "already patched in this process by another patcher")
            return
        flag.add(target.qualname)  # before wrapping: a re-entrant import must not patch twice
        hook = GuardedHook(self, target)
        registry = _registry() if self.route in ("auto", "registry") else None
        if registry is not None:
            first = self._registered_on(resolution.original, target.hook)
            if first is not None:
                # SGLang's registry rebinds every module holding this function to the first
                # target's wrapper (`_propagate_patch`): a second registration would run the
                # same hook twice on every call, and stay after uninstall
                self.applied[(target.module, target.qualname)] = Applied(target, "registry", resolution,
                                                                         first.handle, shared=True)
                self.verified = False
                self.set_status(target, "pending", f"served by the hook registered on {first.target.path}")
                return
            adapter = _registry_adapter(hook)
            registry.HookRegistry.register(target.path, adapter, registry.HookType.AROUND)
            self.applied[(target.module, target.qualname)] = Applied(target, "registry", resolution, adapter)
            self.verified = False
            self.set_status(target, "pending", "registered with SGLang's HookRegistry")
            return
        handle = wrapt.wrap_function_wrapper(target.module, target.qualname, hook)
        self.applied[(target.module, target.qualname)] = Applied(target, "wrapt", resolution, handle)
        self.set_status(target, "patched")

    def _registered_on(self, original: Any, hook: str) -> Applied | None:
        """The registry hook of the same factory already registered on `original`, if any."""
        for applied in self.applied.values():
            if (applied.route == "registry" and not applied.shared and applied.resolution.original is original
                    and applied.target.hook == hook):
                return applied
        return None

    # %% verify

    def verify(self) -> dict[str, tuple[str, str]]:
        """Check every applied hook is in place (the registry only logs a failure)."""
        import wrapt

        self.verified = True  # first: a check that raises is not retried on every hooked call
        self._check_pending()  # outside the lock: find_spec may import, and post-import hooks take it
        with self._lock:
            for key, applied in list(self.applied.items()):
                raw = _owner_entry(applied.target)
                if applied.route == "registry":
                    ok = _chain_holds(raw, applied.handle)
                else:
                    try:
                        ok = wrapt.is_wrapped_by(raw, applied.handle)
                    except Exception:
                        ok = False
                if ok:
                    self.set_status(applied.target, "patched")
                else:
                    self.set_status(applied.target, "not_applied", f"{applied.target.path} is not wrapped after patching")
            return dict(self.status)

    def _check_pending(self) -> None:
        """A target still waiting for its module: is there such a module at all?"""
        import importlib.util

        applied = {a.target.name for a in list(self.applied.values())}
        for target in self.targets:
            if target.name in applied or self.status.get(target.name, ("",))[0] != "pending":
                continue
            try:
                found = importlib.util.find_spec(target.module) is not None
                detail = f"module {target.module} does not exist"
            except Exception as exc:
                found, detail = False, f"module {target.module} cannot be found: {type(exc).__name__}: {exc}"
            if not found:
                self.set_status(target, "missing", detail)

    # %% unpatch

    def unpatch(self) -> None:
        """Take every hook off (hooks that cannot be removed bail out: the runtime is off)."""
        import wrapt

        with self._lock:
            self._active = False
            for key, applied in list(self.applied.items()):
                target = applied.target
                try:
                    if applied.route == "wrapt":
                        wrapt.unwrap_object(target.module, target.qualname, applied.handle, missing_ok=True)
                    elif not applied.shared:  # a shared one goes with the target that registered it
                        self._unregister(applied)
                except Exception:
                    log.warning("dsv4-idxk-probe: could not remove the hook on %s; it stays inert", target.path,
                                exc_info=True)
                flag = getattr(sys.modules.get(target.module), PATCHED_FLAG, None)
                if flag is not None:
                    flag.discard(target.qualname)
                    if not flag:
                        delattr(sys.modules[target.module], PATCHED_FLAG)
                del self.applied[key]

    @staticmethod
    def _unregister(applied: Applied) -> None:
        module = sys.modules["sglang.srt.plugins.hook_registry"]
        registry = module.HookRegistry
        path = applied.target.path
        hooks = registry._hooks.get(path, [])
        hooks[:] = [entry for entry in hooks if entry[1] is not applied.handle]
        raw = _owner_entry(applied.target)
        if not hooks and _chain_holds(raw, applied.handle) and raw.__wrapped__ is applied.resolution.original:
            # ours was the only hook on this target: put the original entry back, in every
            # module SGLang's registry rebound to the wrapper too (module-level functions)
            owner = sys.modules[applied.target.module]
            *parents, attribute = applied.target.qualname.split(".")
            for part in parents:
                owner = getattr(owner, part)
            setattr(owner, attribute, applied.resolution.original)
            if not parents:
                _rebind(raw, applied.resolution.original)
            registry._patched.discard(path)
