"""Thin adapters between SGLang and the probe: the only code that knows SGLang.

Each module here holds wrapper factories ``make_<name>_wrapper(runtime)``
named by the patch-target files under ``configs/targets/``. Importing this
package imports no SGLang module.
"""
