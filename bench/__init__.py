"""The benchmarks, run from the repository root as modules: ``python -m bench.NAME [--help]``.

What the scripts share (timing, pairing, tables, result files) is in
``bench.harness``. This package is not shipped in the wheel (pyproject.toml
finds ``dsv4_idxk_probe*`` only) and imports nothing here, so a script can
prepare its process (e.g. TRITON_INTERPRET, stand-in modules) before the
probe or torch is imported.
"""
