"""What became of a PD room's index-K bytes: verified, or why not (docs/coverage.md).

Decode counts every room once, when it stops tracking it (finished, retracted,
aborted, evicted), into ``coverage_bytes{path="pd", outcome, reason}``: the
room's bytes under the best outcome any of its stages reached. A room whose
stages were compared is `verified` (reason ``none``), whether they matched or
mismatched: a mismatch is verified bytes that were found bad. Otherwise the
outcome of its most telling stage (not_comparable, then unverified, then
skipped) with a low-cardinality reason. Prefill counts nothing here: it
digests what it sends, decode decides whether that digest verified anything,
so the coverage ratio reads decode's counts alone.
"""

from __future__ import annotations

from typing import Any, Collection

from ..background import yield_to_serving
from ..digest.layout import layout_signature
#: How much an outcome says about a room's bytes (a room keeps its highest).
RANK = {"skipped": 0, "unverified": 1, "not_comparable": 2, "verified": 3}
_OUTCOME_OF_VERDICT = {"match": "verified", "mismatch": "verified", "not_comparable": "not_comparable",
                       "unverified": "unverified", "skipped": "skipped"}
# Skip reasons as the hooks and the monitor write them (their first words), and the
# coverage reason each one is.
_SKIP_REASONS = (
    ("retracted", "retracted"),
    ("transfer failed", "transfer_failed"),
    ("aborted", "aborted"),
    ("evicted", "evicted"),
    ("received into the hicache host pool", "host_dest"),
    ("digest failed", "probe_error"),
    ("probe error", "probe_error"),
    ("destination pages were not recorded", "probe_error"),
    ("digest queue full", "queue_full"),
)
#: Rooms that move no real index-K (SGLang's health checks, fake bootstrap hosts,
#: nothing left to receive): never counted.
NOT_MOVED = ("health check", "fake bootstrap host", "nothing to receive", "no bootstrap room")


class RoomCoverage:
    """A room's best outcome so far, its reason, and its bytes (the largest digest of it)."""

    __slots__ = ("outcome", "reason", "nbytes", "counted")

    def __init__(self):
        self.outcome: str | None = None
        self.reason = "other"
        self.nbytes = 0
        self.counted = False

    def fold(self, outcome: str, reason: str, nbytes: int | None = None) -> None:
        if nbytes:
            self.nbytes = max(self.nbytes, int(nbytes))
        if self.outcome is None or RANK.get(outcome, -1) > RANK.get(self.outcome, -1):
            self.outcome, self.reason = outcome, reason

    def count(self, metrics: Any, fallback_bytes: int = 0) -> None:
        """Count the room once (later calls do nothing)."""
        if self.counted or self.outcome is None or metrics is None:
            return
        self.counted = True
        metrics.count_coverage("pd", self.outcome, self.reason, self.nbytes or fallback_bytes)


def skip_reason(text: str) -> str | None:
    """The coverage reason of a `skipped` record's reason text (None: the room moved nothing)."""
    low = str(text or "").lower()
    if low.startswith(NOT_MOVED):
        return None
    for start, reason in _SKIP_REASONS:
        if low.startswith(start):
            return reason
    return "other"


def judged_reason(verdict: str, inband: Any, expected: Any, observed: Any,
                  stage_signatures: Collection[int] = ()) -> str:
    """Why a judged stage was not verified, from the evidence `DecodeMonitor._judge` had.

    not_comparable: prefill's layers a strict part of decode's (a pipeline stage's
    digest against a whole model: ``pp_stage``); the signature differs otherwise
    (``layout_differs``); prefill digested fewer tokens than decode received
    (``truncated_by_transfer``) or more (``length_differs``). unverified: no prefill
    digest in band and none from the exchange (``no_exchange``). With the in-band digest
    alone, a signature among `stage_signatures` (see there) is a pipeline stage's.
    """
    if verdict in ("match", "mismatch"):
        return "none"
    if verdict == "unverified":
        return "no_exchange"
    if verdict != "not_comparable":
        return "other"
    if expected is not None and observed is not None:
        theirs, ours = set(_ints(expected.layer_ids)), set(_ints(observed.layer_ids))
        if theirs != ours and theirs < ours:
            return "pp_stage"
        if expected.signature != observed.signature or theirs != ours:
            return "layout_differs"
        return _length_reason(expected.n_tokens, observed.n_tokens)
    if inband is not None and observed is not None:
        if inband.signature != observed.signature:
            return "pp_stage" if inband.signature in stage_signatures else "layout_differs"
        return _length_reason(inband.n_tokens, observed.n_tokens)
    return "other"


def stage_signatures(layout: Any, layer_ids) -> frozenset[int]:
    """The signatures a pipeline stage of this model would put in band: one per contiguous
    proper run of `layer_ids` (a stage holds a run of the model's layers). Made once per
    monitor, on the collector, at its first not-comparable verdict (43 C4 layers: ~900, some
    50 ms of CPU in all, the GIL offered back after each run start)."""
    ids = [int(i) for i in layer_ids]
    n = len(ids)
    out: set[int] = set()
    for i in range(n):
        out.update(layout_signature(layout, ids[i:j]) for j in range(i + 1, n + 1) if j - i < n)
        yield_to_serving()  # ~1 ms a run start: the serving thread gets the GIL in between
    return frozenset(out)


def outcome_of(verdict: str) -> str:
    return _OUTCOME_OF_VERDICT.get(verdict, "unverified")


def estimated_bytes(engine: Any, n_tokens: int | None) -> int:
    """Frozen index-K bytes a room of `n_tokens` holds in `engine`'s pool (what a digest
    of it would read): for rooms no digest of which came back."""
    try:
        layout = engine.layout
        slots = max(0, int(n_tokens or 0)) // int(layout.tokens_per_slot)
        return slots * len(engine.layer_ids) * sum(int(s.slot_bytes) for s in layout.segments)
    except Exception:  # a stand-in engine without a layout: bytes unknown
        return 0


def _length_reason(prefill_tokens: int, decode_tokens: int) -> str:
    if prefill_tokens == decode_tokens:
        return "other"
    return "truncated_by_transfer" if prefill_tokens < decode_tokens else "length_differs"


def _ints(values) -> list[int]:
    return [int(v) for v in values]

