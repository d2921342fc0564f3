"""SGLang's request id (rid) reaches every room record, on both sides, and `diff --rid` selects by it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.pd import DecodeMonitor, InbandDigest, PrefillMonitor, RoomId
from dsv4_idxk_probe.pd.records import room_record

from tests.support.logdata import Fault, RoomPlan, room_records
from tests.support.recordsink import Sink

LAYER_IDS = [0, 1]
LAYOUT = get_layout("fp8")


def buffers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (8, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in LAYER_IDS]


def test_monitors_write_the_rid_on_every_record():
    bufs = buffers(1)
    pre_sink, dec_sink = Sink(), Sink()
    prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, bufs), pre_sink)
    decode = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, bufs), dec_sink, fetch_vectors=prefill.lookup, step_interval=2)
    try:
        room, other = RoomId(7), RoomId(8)
        pending = prefill.room_sent(room, [0, 1], 100, extra={"rid": "req-prefill-7"})
        prefill.room_sent(other, [2], 50)  # a hook that knows no rid
        (sent7, sent8) = sorted(pre_sink.wait_for(2), key=lambda r: r["room"])
        assert sent7["rid"] == "req-prefill-7" and "extra" not in sent7
        assert sent8["rid"] is None
        assert len(prefill.recent) == 2  # the exchange's table; extras ride with the batch's callback, in no table
        pending.ready()
        inband = InbandDigest(int(pending.room_digests[0]), prefill.engine.signature, 100)
        decode.room_received(room, [0, 1], 100, inband, {"rid": "req-decode-7", "prefill_endpoint": "h:1"})
        decode.batch_done([], [(room, 2)])
        decode.room_finished(room)
        decode.room_skipped(RoomId(9), "aborted", extra={"rid": "req-decode-9"})
        records = dec_sink.wait_for(4)
        by_room = {}
        for r in records:
            by_room.setdefault(r["room"], []).append(r)
        assert {r["rid"] for r in by_room["7"]} == {"req-decode-7"} and len(by_room["7"]) == 3
        assert all(r["extra"] == {"prefill_endpoint": "h:1"} for r in by_room["7"])
        assert by_room["9"][0]["rid"] == "req-decode-9" and by_room["9"][0]["verdict"] == "skipped"
    finally:
        prefill.engine.close()
        decode.engine.close()


def write(path: Path, records: list[dict]) -> None:
    from dsv4_idxk_probe.roomlog import RoomLogWriter

    writer = RoomLogWriter(path.parent, path.name, max_files=10)
    for r in records:
        assert writer.emit(r)
    writer.close()


def test_diff_selects_by_either_sides_rid(tmp_path, capsys):
    pre, dec = [], []
    for plan in (RoomPlan(5), RoomPlan(6, fault=Fault(1, 0, 3)), RoomPlan(40)):
        p, d = room_records(plan)
        pre += [{**r, "rid": f"p-{plan.room}"} for r in p]
        dec += [{**r, "rid": f"d-{plan.room}"} for r in d]
    write(tmp_path / "logs" / "prefill", pre)
    write(tmp_path / "logs" / "decode", dec)
    logs = str(tmp_path / "logs")

    assert run(["diff", logs, "--rid", "d-5", "--json", str(tmp_path / "one.json")]) == 0
    out = capsys.readouterr().out
    assert "selected rooms (1 of 1" in out and "5/0" in out and "d-5,p-5" in out and "6/0" not in out
    doc = json.loads((tmp_path / "one.json").read_text())
    assert [(r["room"], r["rid"]) for r in doc["rooms"]] == [("5", {"prefill": "p-5", "decode": "d-5"})]

    assert run(["diff", logs, "--rid", "p-6", "--rid", "d-40"]) == 1  # the selection holds the mismatch
    out = capsys.readouterr().out
    assert "6/0" in out and "40/0" in out and "5/0" not in out

    assert run(["diff", logs, "--rid", "nope"]) == 2
    assert "no room in these logs has rid nope" in capsys.readouterr().err


def test_a_bad_rid_is_a_bad_line_not_a_crash(tmp_path, capsys):
    p, d = room_records(RoomPlan(3))
    write(tmp_path / "l" / "prefill", p)
    write(tmp_path / "l" / "decode", [{**d[0], "rid": 12}, *d[1:]])
    assert run(["diff", str(tmp_path / "l")]) == 2
    assert "rid must be a non-empty string or null" in capsys.readouterr().err


def test_room_record_takes_the_rid_from_extra_or_argument():
    rec = room_record(role="decode", stage="decode_recv", room=1, attempt=0, digest=None, layout="fp8",
                      extra={"rid": "r1", "x": 1})
    assert rec["rid"] == "r1" and rec["extra"] == {"x": 1}
    rec = room_record(role="decode", stage="decode_recv", room=1, attempt=0, digest=None, layout="fp8", rid="r2")
    assert rec["rid"] == "r2" and "extra" not in rec
