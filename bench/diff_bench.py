#!/usr/bin/env python3
"""Benchmark `dsv4-idxk-probe diff` on synthetic room logs (target: 1M rooms < 60 s, one core).

Each room gets a prefill record and decode records at decode_recv and
decode_finish (plus decode_step if --steps), with realistic small digests
(--layers x 2 segments, --pages pages) in the exact line format the writer
produces. Every --mismatch-every-th room is corrupted at decode_finish and
every --unverified-every-th room has no prefill record, so the diff does
real comparisons and localisations; the run checks the diff found exactly
those. The diff runs as the CLI, in a child process pinned to one core.

    python -m bench.diff_bench --rooms 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4_idxk_probe.pd.records import room_record
from dsv4_idxk_probe.roomlog.lineformat import encode_line

SEGMENTS = ["payload", "scale"]
FILE_BYTES = 256 << 20  # rotate like the writer would


class _Digest:
    """Stands in for RoomDigest in `room_record`: the record is what `to_record` returns."""

    def __init__(self, record: dict):
        self.record = record

    def to_record(self) -> dict:
        return self.record


def make_digest(room: int, layers: int, pages: int, signature: str) -> dict:
    blob = os.urandom(8 * (layers * len(SEGMENTS) + pages)).hex()
    values = [blob[i : i + 16] for i in range(0, len(blob), 16)]
    cells = values[: layers * len(SEGMENTS)]
    fold = sum(int(v, 16) for v in cells) & ((1 << 64) - 1)
    return {
        "key": f"{room}/0",
        "signature": signature,
        "n_tokens": pages * 256 - 100,
        "layer_ids": list(range(layers)),
        "segments": SEGMENTS,
        "room": f"{fold:016x}",
        "layer_segment": [cells[i : i + len(SEGMENTS)] for i in range(0, len(cells), len(SEGMENTS))],
        "pages": values[layers * len(SEGMENTS) :],
    }


def corrupt(digest: dict, room: int) -> dict:
    """One (layer, page, segment) cell changed: its layer row, page entry and room fold move."""
    bad = json.loads(json.dumps(digest))
    layer, page = room % len(bad["layer_segment"]), room % len(bad["pages"])
    bad["layer_segment"][layer][0] = f"{int(bad['layer_segment'][layer][0], 16) ^ 0x5A5A:016x}"
    bad["pages"][page] = f"{int(bad['pages'][page], 16) ^ 0x5A5A:016x}"
    return bad


class RotatingFile:
    def __init__(self, directory: Path, stem: str):
        self.directory, self.stem, self.seq, self.f, self.size = directory, stem, 0, None, 0
        directory.mkdir(parents=True, exist_ok=True)
        self.bytes = 0

    def write(self, line: bytes) -> None:
        if self.f is None or self.size + len(line) > FILE_BYTES:
            if self.f:
                self.f.close()
            self.seq += 1
            self.f = open(self.directory / f"{self.stem}.{self.seq:06d}.jsonl", "wb", buffering=1 << 20)
            self.size = 0
        self.f.write(line)
        self.size += len(line)
        self.bytes += len(line)

    def close(self) -> None:
        if self.f:
            self.f.close()


def generate(root: Path, rooms: int, layers: int, pages: int, steps: int, mismatch_every: int, unverified_every: int) -> dict:
    prefill = RotatingFile(root / "prefill", "prefill-bench-1")
    decode = RotatingFile(root / "decode", "decode-bench-2")
    signature = os.urandom(8).hex()
    expected = {"rooms": rooms, "mismatch": 0, "unverified": 0}
    stages = [("decode_recv", None)] + [("decode_step", 32 * (i + 1)) for i in range(steps)] + [("decode_finish", None)]
    for room in range(1, rooms + 1):
        digest = make_digest(room, layers, pages, signature)
        if room % unverified_every:
            prefill.write(encode_line(room_record(role="prefill", stage="prefill_send", room=room, attempt=0,
                                                  digest=_Digest(digest), layout="fp8")))
        else:
            expected["unverified"] += 1
        bad = room % mismatch_every == 0 and room % unverified_every != 0
        expected["mismatch"] += bad
        for stage, step in stages:
            seen = corrupt(digest, room) if bad and stage == "decode_finish" else digest
            decode.write(encode_line(room_record(role="decode", stage=stage, room=room, attempt=0, digest=_Digest(seen),
                                                 layout="fp8", step=step, verdict="match")))
    prefill.close()
    decode.close()
    expected["lines"] = rooms * len(stages) + rooms - expected["unverified"]
    expected["bytes"] = prefill.bytes + decode.bytes
    expected["files"] = prefill.seq + decode.seq
    return expected


# Runs the CLI with orjson made unimportable: the standard-library fallback.
_WITHOUT_ORJSON = "import sys; sys.modules['orjson'] = None; from dsv4_idxk_probe.cli.main import run; sys.exit(run())"


def run_diff(root: Path, core: int, stdlib_json: bool) -> dict:
    out_json = root / "diff.json"
    entry = ["-c", _WITHOUT_ORJSON] if stdlib_json else ["-m", "dsv4_idxk_probe"]
    cmd = [sys.executable, *entry, "diff", str(root / "prefill"), str(root / "decode"), "--json", str(out_json)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    return {
        "command": f"taskset -c {core} dsv4-idxk-probe diff PREFILL_DIR DECODE_DIR --json diff.json"
        + (" (orjson hidden: stdlib json)" if stdlib_json else ""),
        "exit_status": os.waitstatus_to_exitcode(status),
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_mib": usage.ru_maxrss / 1024,
        "stderr": stderr[-2000:],
        "summary": json.loads(out_json.read_text()[: 1 << 20].split(',"rooms":[')[0] + "}")["summary"],
        "json_mib": out_json.stat().st_size / (1 << 20),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=1_000_000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--steps", type=int, default=0, help="decode_step records per room")
    parser.add_argument("--mismatch-every", type=int, default=1000)
    parser.add_argument("--unverified-every", type=int, default=10_000)
    parser.add_argument("--core", type=int, default=0, help="CPU the diff is pinned to")
    parser.add_argument("--stdlib-json", action="store_true", help="hide orjson from the diff (measure the fallback)")
    parser.add_argument("--dir", type=Path, help="where the logs go (default: a temporary directory, removed)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="diff-bench-", dir=args.dir))
    try:
        t = time.perf_counter()
        expected = generate(root, args.rooms, args.layers, args.pages, args.steps, args.mismatch_every, args.unverified_every)
        gen_s = time.perf_counter() - t
        result = run_diff(root, args.core, args.stdlib_json)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    s = result["summary"]
    found = {"rooms": s["rooms"], "mismatch": s["room_verdicts"].get("mismatch", 0),
             "unverified": s["room_verdicts"].get("unverified", 0)}
    correct = found == {k: expected[k] for k in found} and s["bad_lines"] == 0 and result["exit_status"] == 1
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"logs: {args.rooms:,} rooms, {expected['lines']:,} lines, {expected['bytes'] / 1e9:.2f} GB in "
          f"{expected['files']} files ({args.layers} layers x {args.pages} pages, {args.steps} decode_step per room); "
          f"generated in {gen_s:.0f} s")
    print(f"command: {result['command']}")
    print(f"diff: wall {result['wall_s']:.1f} s, cpu {result['cpu_s']:.1f} s, "
          f"{args.rooms / result['wall_s']:,.0f} rooms/s, {expected['bytes'] / result['wall_s'] / 1e6:.0f} MB/s, "
          f"peak RSS {result['max_rss_mib']:.0f} MiB, JSON {result['json_mib']:.0f} MiB, exit {result['exit_status']}")
    print(f"found {found} (expected {({k: expected[k] for k in found})}): {'correct' if correct else 'WRONG'}")
    if not correct:
        print(result["stderr"], file=sys.stderr)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
