"""The probe's environment variables, named once.

Nothing else in the package spells these strings; import the constants.
"""

#: Switches the probe on in every process that loads it (SGLang's plugin
#: loader, or the ``.pth`` route). Unset, empty, ``0``, ``off`` or ``false``:
#: nothing happens (no torch or SGLang import, no patch). ``1``, ``on``,
#: ``true`` or ``observe``: observe (mode from the config file, default
#: observe). ``enforce``: also drop rooms whose index-K mismatches at receipt.
DSV4_IDXK_PROBE = "DSV4_IDXK_PROBE"

#: Path of the probe's YAML config file (docs/configuration.md). Optional.
DSV4_IDXK_PROBE_CONFIG = "DSV4_IDXK_PROBE_CONFIG"

#: Fault-injection spec read by the local PD rig (dsv4_idxk_probe/testbed/builtin). The
#: config loader refuses it together with ``enforce``.
DSV4_IDXK_PROBE_FAULTS = "DSV4_IDXK_PROBE_FAULTS"

#: Comma-separated patch-target files (shipped names such as
#: ``sglang``, ``sglang@0.5.21``, ``fork-prefill2-decode2`` or paths); overrides the config's ``targets``.
DSV4_IDXK_PROBE_TARGETS = "DSV4_IDXK_PROBE_TARGETS"

OFF_VALUES = ("", "0", "off", "false", "no")
OBSERVE_VALUES = ("1", "on", "true", "yes", "observe")
ENFORCE_VALUES = ("enforce",)


def requested_mode(value: str | None) -> str | None:
    """Mode asked for by a ``DSV4_IDXK_PROBE`` value: None (off), "default",
    "observe" or "enforce". "default" (``1``) lets the config file choose.

    Raises ValueError naming the variable on any other value.
    """
    text = (value or "").strip().lower()
    if text in OFF_VALUES:
        return None
    if text in ("1", "on", "true", "yes"):
        return "default"
    if text in OBSERVE_VALUES:
        return "observe"
    if text in ENFORCE_VALUES:
        return "enforce"
    raise ValueError(
        f"{DSV4_IDXK_PROBE}={value!r} is not understood; use one of 0, 1, observe, enforce"
    )
