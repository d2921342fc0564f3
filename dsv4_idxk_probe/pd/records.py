"""Room-log records: what each stage of a room's life writes.

One record per (room, attempt, stage[, step]). The schema is versioned
(``v``) and documented in docs/roomlog.md; the room log writer adds a
per-line checksum. ``room`` is SGLang's bootstrap room (what both sides
share); ``rid`` is SGLang's request id on the side that wrote the record
(what that server's request logs show), null when the hook did not know it. Prefill records carry the full digest (room value, the
(layer, segment) matrix and the page vector) so `diff` can localise from the
logs alone; decode records carry their own digest plus the verdict they
reached live. Where the probe config names a cluster (``roomlog.cluster``,
`set_cluster`), every record carries it as ``cluster``, and `diff` joins on
it: the same room id from two clusters is then two rooms.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from ..digest.result import Comparison, RoomDigest
from ..vocabulary import SCHEMA_VERSION, STAGES, VERDICTS



_instance: tuple[int, str] = (-1, "")
_cluster = ""  # this process's cluster label (config roomlog.cluster); "" writes none


def set_cluster(label: str | None) -> None:
    """The cluster label every record of this process carries from now on ("" or None: none)."""
    global _cluster
    _cluster = str(label or "")


def cluster_label() -> str:
    return _cluster


def instance_id() -> str:
    """host:pid, to tell processes apart in merged logs (looked up once per process:
    gethostname is a system call, and every record asks)."""
    global _instance
    pid = os.getpid()
    if _instance[0] != pid:
        _instance = (pid, f"{socket.gethostname()}:{pid}")
    return _instance[1]


def room_record(
    *,
    role: str,
    stage: str,
    room: int | str,
    attempt: int,
    digest: RoomDigest | None,
    layout: str,
    step: int | None = None,
    verdict: str | None = None,
    reason: str = "",
    expected_room: int | None = None,
    comparison: Comparison | None = None,
    first_divergence: str | None = None,
    extra: dict[str, Any] | None = None,
    tokens: int | None = None,
    rid: str | None = None,
    diagnosis: list[dict] | None = None,
    page_events: dict[str, list] | None = None,
    digest_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build one ``kind: room`` record (plain JSON types only).

    `digest_record`: `digest.to_record()` where the caller has it already (decode keeps
    a room's, its digests at every stage being nearly always the same bytes).

    `rid` may also come in `extra` (``{"rid": ...}``, as the hooks pass it):
    it is written as the record's own ``rid`` field either way.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    if verdict is not None and verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r}")
    record: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "kind": "room",
        "ts": time.time(),
        "role": role,
        "instance": instance_id(),
        "room": str(room),
        "attempt": int(attempt),
        "stage": stage,
        "step": step,
        "layout": layout,
        "digest": (digest_record if digest_record is not None else digest.to_record()) if digest is not None else None,
        "verdict": verdict,
        "reason": reason,
        "expected_room": f"{expected_room:016x}" if expected_room is not None else None,
        "localisation": comparison.to_record() if comparison is not None and comparison.verdict == "mismatch" else None,
        "first_divergence": first_divergence,
    }
    if diagnosis is not None:  # per bad cell: what its bytes became (docs/diagnosis.md)
        record["diagnosis"] = diagnosis
    if page_events:  # a mismatch decode could not localise: each page's journal events, for the diff
        record["page_events"] = page_events
    if tokens is not None and digest is None:  # which transfer a record without a digest belongs to
        record["tokens"] = int(tokens)
    if extra and "rid" in extra:
        extra = dict(extra)
        extra_rid = extra.pop("rid")
        rid = extra_rid if rid is None else rid
    record["rid"] = str(rid) if rid is not None else None
    if _cluster:
        record["cluster"] = _cluster
    if extra:
        record["extra"] = extra
    return record
