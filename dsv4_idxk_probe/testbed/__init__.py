"""The test beds: where the probe is run against known faults, never shipped into serving.

- `faults/`: the fault spec, its injection, the expected findings, the content
  model and the verification of a run against the byte oracle, plus the room
  plan both beds share;
- `builtin/`: our own two-process PD rig over real NIXL (GPU benchmarks, fast tests);
- `sglang/`: SGLang's own prefill and decode servers with the probe in them.

No product module imports this package (an import-contract test keeps it so);
the `demo` command imports it lazily. See docs/architecture.md.
"""
