"""What to check next, per diagnosis kind: the suspect and the evidence to collect.

One table, shown by `report` beside each bad room and kept equal to docs/diagnosis.md's
"What to check next" table by a test (tests/offline/test_report_operator.py). Plain text:
the page escapes it like everything else. Keyed by `vocabulary.DIAGNOSIS_KINDS`, plus
"mismatch" for a room whose cells were not diagnosed (diagnosis off, or not localised).
"""

from __future__ import annotations

NEXT_STEPS: dict[str, tuple[str, str]] = {
    # kind: (suspect, evidence to collect)
    "zeroed": (
        "a transfer or HiCache load that wrote zeros, or a page never written",
        "the transfer engine's logs (Mooncake/NIXL) for the room's bootstrap room and rid on both pods; "
        "HiCache load/backup events in the page's journal; the GPU's XID/ECC counters (DCGM)",
    ),
    "previous_occupant": (
        "a write that never landed (stale page) or a torn write",
        "the transfer engine's logs for a failed or retried transfer of the room; the page's journal events "
        "(free, reuse, HiCache load) before the transfer; SGLang's KV transfer failure counters",
    ),
    "other_room": (
        "a page mapped to two rooms (page-table or allocator bug), or a swapped transfer",
        "the named other room's rid and pods (report --rid); SGLang's allocator and retraction logs around the "
        "wall time; HiCache host-row reuse (round-trip mode: hicache.roundtrip)",
    ),
    "unknown": (
        "bit flips, memory written by something no hook sees, or a torn write",
        "the GPU's XID and ECC counters via DCGM (dashboard 'XID and ECC per probed GPU', joined on the GPU UUID); "
        "nvidia-smi -q -d ECC,ROW_REMAPPER on the node; the transfer engine's logs",
    ),
    "mismatch": (
        "not diagnosed: any of the above",
        "turn diagnosis on (config diagnosis.enabled) to classify the bad cells; meanwhile the transfer engine's "
        "logs and the GPU's XID/ECC counters (DCGM)",
    ),
}


def next_steps(kinds) -> list[tuple[str, str, str]]:
    """(kind, suspect, evidence) for each distinct kind in `kinds`, in NEXT_STEPS order;
    the "mismatch" row when no kind is known."""
    wanted = {k for k in kinds if k in NEXT_STEPS} or {"mismatch"}
    return [(k, *NEXT_STEPS[k]) for k in NEXT_STEPS if k in wanted]
