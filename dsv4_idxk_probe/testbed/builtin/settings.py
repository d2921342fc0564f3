"""What a rig child reads from its environment: the one place the rig does so.

The rig's children are switched on exactly as SGLang's processes are: by
``DSV4_IDXK_PROBE`` (and ``DSV4_IDXK_PROBE_CONFIG``) in their environment,
validated by the product's own loader (`dsv4_idxk_probe.config`), plus
``DSV4_IDXK_PROBE_FAULTS`` for fault injection. Keeping every read here means
a change of names or schema is one edit here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ... import environment_variables as ev
from ...config import ConfigError, ProbeConfig, load_config

__all__ = ["ConfigError", "RigSettings", "read_settings", "child_env", "child_view", "rig_defaults"]


@dataclass(frozen=True)
class RigSettings:
    """The probe's state in one rig process: on or off, its config, the fault file."""

    enabled: bool
    config: ProbeConfig
    faults_path: str | None

    @property
    def step_interval(self) -> int:
        return self.config.step_interval


def read_settings(environ: Mapping[str, str] | None = None) -> RigSettings:
    """Read the probe's variables and config file; ConfigError names the file and field.

    The product's loader also refuses fault injection together with enforce.
    """
    env = os.environ if environ is None else environ
    config = load_config(env)
    enabled = ev.requested_mode(env.get(ev.DSV4_IDXK_PROBE)) is not None
    faults = env.get(ev.DSV4_IDXK_PROBE_FAULTS, "").strip() or None
    return RigSettings(enabled, config, faults)


def child_env(*, probe: bool | str = True, config: str | None = None, faults: str | None = None) -> dict[str, str]:
    """Environment overrides that switch a child's probe on (or off), as on a real pod."""
    env = {ev.DSV4_IDXK_PROBE: probe if isinstance(probe, str) else ("1" if probe else "0")}
    if config:
        env[ev.DSV4_IDXK_PROBE_CONFIG] = str(config)
    if faults:
        env[ev.DSV4_IDXK_PROBE_FAULTS] = str(faults)
    return env


def child_view(overrides: Mapping[str, str]) -> dict[str, str]:
    """The environment a child will see: this process's, plus its overrides."""
    return {**os.environ, **overrides}


def rig_defaults() -> dict[str, str]:
    """Variables the rig sets for its children unless the user did: NIXL's INFO lines go to stdout."""
    return {"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
