"""The local PD rig: a prefill and a decode process moving DeepSeek-V4 index-K
pages over real NIXL, with the probe switched on through its environment
variable and faults injected where production would suffer them.

Usage::

    from dsv4_idxk_probe.testbed.builtin.config import RigConfig, RoleEnv
    from dsv4_idxk_probe.testbed.builtin.rig import run_rig
    from dsv4_idxk_probe.testbed.builtin.settings import child_env

    result = run_rig(RigConfig(rooms=50), RoleEnv(common=child_env(config="probe.yaml", faults="faults.yaml")))

`dsv4-idxk-probe demo` wraps this with a progress bar, the diff and a
verdict on the probe. See docs/rig.md and docs/faults.md. Importing this
package imports nothing else.
"""
