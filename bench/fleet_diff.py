"""A fleet's day of room logs: the DuckDB engine of `diff` against the reference join.

Generates `--records` room-log records in `--files` files (half prefill pods, half decode
pods; every room's prefill record on a prefill pod, its decode records on a decode pod),
each line in the writer's exact format with its checksum, fast (one digest text per room,
reused by its records). Every `--mismatch-every`-th room is corrupted at decode_finish and
every `--unverified-every`-th has no prefill record, so both engines do real comparisons.

Then `dsv4-idxk-probe diff` runs as a child process: the fleet engine with the native line
pass on the whole set, its clean keys judged by the native room table where it was built
(`--duckdb-judge`: by DuckDB too; `--python-pass`: its pure-Python pass too), and it and the reference
on a subset of `--reference-records` records generated the same way (the
reference on 10^7 records would take ~an hour and ~15 GB here). Reported per engine: wall,
CPU (user + sys, all threads), peak RSS of the process (DuckDB included: `wait4`'s
ru_maxrss, taken by a small wrapper so that this process's own size does not count), microseconds of CPU per record; the ratio of CPU per record is the per-core
speed-up. Both engines' summaries on the subset must be equal.

    python -m bench.fleet_diff --records 10000000 --files 1000
    python -m bench.fleet_diff --records 1000000 --files 1000 --reference-records 1000000
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

import xxhash

from bench.harness import REPO, Table, command_line, write_result

SEGMENTS = ("payload", "scale")


def _digest_text(room: int, layers: int, pages: int, signature: str, n_tokens: int) -> tuple[str, str]:
    """The digest object as the writer serialises it (orjson, compact), and a corrupted copy."""
    blob = os.urandom(8 * (layers * len(SEGMENTS) + pages)).hex()
    values = [blob[i:i + 16] for i in range(0, len(blob), 16)]
    cells, page_values = values[: layers * len(SEGMENTS)], values[layers * len(SEGMENTS):]
    fold = sum(int(v, 16) for v in cells) & ((1 << 64) - 1)

    def text(cells, page_values, fold):
        rows = ",".join("[" + ",".join(f'"{c}"' for c in cells[i:i + len(SEGMENTS)]) + "]"
                        for i in range(0, len(cells), len(SEGMENTS)))
        return ('{"key":"%d/0","signature":"%s","n_tokens":%d,"layer_ids":[%s],"segments":["%s"],"room":"%016x",'
                '"layer_segment":[%s],"pages":[%s]}' % (
                    room, signature, n_tokens, ",".join(str(i) for i in range(layers)), '","'.join(SEGMENTS),
                    fold, rows, ",".join(f'"{p}"' for p in page_values)))

    good = text(cells, page_values, fold)
    bad_cells = list(cells)
    layer = room % layers
    bad_cells[layer * len(SEGMENTS)] = f"{int(bad_cells[layer * len(SEGMENTS)], 16) ^ 0x5A5A:016x}"
    bad_pages = list(page_values)
    bad_pages[room % pages] = f"{int(bad_pages[room % pages], 16) ^ 0x5A5A:016x}"
    bad_fold = sum(int(v, 16) for v in bad_cells) & ((1 << 64) - 1)
    return good, text(bad_cells, bad_pages, bad_fold)


def _line(ts: float, role: str, instance: str, room: int, stage: str, step: int | None, digest: str,
          verdict: str | None) -> bytes:
    """One record as `room_record` + `encode_line` write it."""
    head = ('{"v":1,"kind":"room","ts":%r,"role":"%s","instance":"%s","room":"%d","attempt":0,"stage":"%s",'
            '"step":%s,"layout":"fp8","digest":%s,"verdict":%s,"reason":"","expected_room":null,'
            '"localisation":null,"first_divergence":null,"rid":null' % (
                ts, role, instance, room, stage, "null" if step is None else step, digest,
                "null" if verdict is None else f'"{verdict}"')).encode()
    return b'%s,"h":"%s"}\n' % (head, xxhash.xxh64_hexdigest(head).encode())


def generate(root: Path, records: int, files: int, *, layers: int, pages: int, steps: int,
             mismatch_every: int, unverified_every: int) -> dict:
    """The log set; returns what the diff must find."""
    n_pre, n_dec = max(1, files // 2), max(1, files - files // 2)
    (root / "prefill").mkdir(parents=True)
    (root / "decode").mkdir(parents=True)
    pre = [open(root / "prefill" / f"prefill-pod{i:04d}-1.000001.jsonl", "wb", buffering=1 << 20) for i in range(n_pre)]
    dec = [open(root / "decode" / f"decode-pod{i:04d}-2.000001.jsonl", "wb", buffering=1 << 20) for i in range(n_dec)]
    per_room = 1 + 2 + steps
    signature = os.urandom(8).hex()
    n_tokens = pages * 256 - 100
    expected = {"rooms": 0, "mismatch": 0, "unverified": 0, "records": 0, "bytes": 0}
    room, ts = 0, 1.7e9
    try:
        while expected["records"] + per_room - (0 if room % unverified_every else 1) <= records:
            room += 1
            good, bad = _digest_text(room, layers, pages, signature, n_tokens)
            lines = 0
            if room % unverified_every:
                line = _line(ts, "prefill", f"prefill-{room % n_pre}:1", room, "prefill_send", None, good, None)
                pre[room % n_pre].write(line)
                expected["bytes"] += len(line)
                lines += 1
            else:
                expected["unverified"] += 1
            corrupt = room % mismatch_every == 0 and room % unverified_every != 0
            expected["mismatch"] += corrupt
            out = dec[room % n_dec]
            stages = [("decode_recv", None)] + [("decode_step", 32 * (k + 1)) for k in range(steps)] + [("decode_finish", None)]
            for stage, step in stages:
                ts += 0.0001
                digest = bad if corrupt and stage == "decode_finish" else good
                line = _line(ts, "decode", f"decode-{room % n_dec}:2", room, stage, step, digest, "match")
                out.write(line)
                expected["bytes"] += len(line)
                lines += 1
            expected["records"] += lines
            expected["rooms"] += 1
    finally:
        for f in pre + dec:
            f.close()
    expected["files"] = n_pre + n_dec
    return expected


def check_format(root: Path) -> None:
    """The generated lines are what the writer writes: checked against `encode_line`."""
    from dsv4_idxk_probe.roomlog.lineformat import decode_line, encode_line

    first = next((root / "decode").glob("*.jsonl")).open("rb").readline()
    record = decode_line(first)
    assert encode_line(record) == first, "generated line differs from the writer's"


# Linux counts a parent's resident size at fork in the child's ru_maxrss (the high-water mark
# survives exec), and this process holds ~1 GB after generating (a buffer per open file): each
# diff is forked from a small wrapper instead, which reports its own child's peak.
_WRAP = ("import os, sys\n"
         "pid = os.fork()\n"
         "if pid == 0:\n"
         "    os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
         "_, status, usage = os.wait4(pid, 0)\n"
         "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
         "sys.exit(os.waitstatus_to_exitcode(status))\n")

# what each engine row runs: `diff --engine`, and the fleet engine's line pass (docs/fleet.md)
# "native": the native pass with the room table judging the clean keys (where it was built);
# "native-duckdb": the native pass with DuckDB judging them (DSV4_IDXK_PROBE_FLEET_TABLE=0)
ENGINES = {"native": ("duckdb", "1"), "native-duckdb": ("duckdb", "1"), "duckdb-python": ("duckdb", "0"),
           "reference": ("reference", None)}


def run_diff(root: Path, engine: str, out: Path, extra: list[str]) -> dict:
    cli_engine, native = ENGINES[engine]
    rss_file = out.with_suffix(".maxrss")
    cmd = [sys.executable, "-c", _WRAP, str(rss_file), "-m", "dsv4_idxk_probe", "diff", str(root / "prefill"), str(root / "decode"),
           "--engine", cli_engine, "--json", str(out), *extra]
    env = dict(os.environ)
    if native is not None:
        env["DSV4_IDXK_PROBE_FLEET_NATIVE"] = native
    env.pop("DSV4_IDXK_PROBE_FLEET_TABLE", None)
    if engine == "native-duckdb":
        env["DSV4_IDXK_PROBE_FLEET_TABLE"] = "0"
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=env)
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.stderr.close()
    wall = time.perf_counter() - start
    with open(out, "rb") as f:
        head = f.read(1 << 20).split(b',"rooms":[')[0] + b"}"
    return {
        "engine": engine,
        "command": " ".join(([f"DSV4_IDXK_PROBE_FLEET_NATIVE={native}"] if native is not None else [])
                            + (["DSV4_IDXK_PROBE_FLEET_TABLE=0"] if engine == "native-duckdb" else [])
                            + ["dsv4-idxk-probe", "diff", "PREFILL", "DECODE", "--engine", cli_engine, "--json", "OUT",
                               *extra]),
        "line_pass": next((ln for ln in stderr.splitlines() if "line pass:" in ln), "").split("] ")[-1],
        "clean_judge": next((ln for ln in stderr.splitlines() if "clean keys judged by" in ln), "").split("] ")[-1],
        "exit_status": os.waitstatus_to_exitcode(status),
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_mib": int(rss_file.read_text()) / 1024,
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # the machine is shared
        "summary": json.loads(head)["summary"],
        "stderr_tail": stderr[-1500:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--reference-records", type=int, default=1_000_000,
                        help="records of the subset both engines run on (0: the reference runs on the full set)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1, help="decode_step records per room")
    parser.add_argument("--mismatch-every", type=int, default=1000)
    parser.add_argument("--unverified-every", type=int, default=10_000)
    parser.add_argument("--memory-limit", default="1GB")
    parser.add_argument("--duckdb-judge", action="store_true",
                        help="also run the native pass with DuckDB judging the clean keys (the room table off)")
    parser.add_argument("--python-pass", action="store_true",
                        help="also run the fleet engine's pure-Python line pass (its fallback without the native module)")
    parser.add_argument("--dir", type=Path, help="where the logs go (default: a temporary directory, removed)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="fleet-bench-", dir=args.dir))
    shape = dict(layers=args.layers, pages=args.pages, steps=args.steps,
                 mismatch_every=args.mismatch_every, unverified_every=args.unverified_every)
    results: dict = {"command": command_line("fleet_diff", argv), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                     f"Python {platform.python_version()}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        runs = []
        sets = [("full", args.records)]
        if args.reference_records and args.reference_records < args.records:
            sets.append(("subset", args.reference_records))
        for name, records in sets:
            t = time.perf_counter()
            expected = generate(root / name, records, args.files, **shape)
            gen_s = time.perf_counter() - t
            check_format(root / name)
            os.sync()  # the set's dirty pages written back now, not during (and charged to) the first timed diff
            print(f"{name}: {expected['records']:,} records, {expected['rooms']:,} rooms, "
                  f"{expected['bytes'] / 1e9:.2f} GB in {expected['files']} files, generated in {gen_s:.0f} s", flush=True)
            engines = ["native"] + (["native-duckdb"] if args.duckdb_judge else []) \
                + (["duckdb-python"] if args.python_pass else []) \
                + (["reference"] if name == "subset" or len(sets) == 1 else [])
            for engine in engines:
                r = run_diff(root / name, engine, root / f"{name}-{engine}.json", ["--memory-limit", args.memory_limit]
                             if engine != "reference" else [])
                s = r["summary"]
                found = {"rooms": s["rooms"], "mismatch": s["room_verdicts"].get("mismatch", 0),
                         "unverified": s["room_verdicts"].get("unverified", 0)}
                r.update(set=name, records=expected["records"], files=expected["files"], bytes=expected["bytes"],
                         generate_s=gen_s, cpu_us_per_record=1e6 * r["cpu_s"] / expected["records"],
                         correct=found == {k: expected[k] for k in found}
                         and r["exit_status"] == (1 if expected["mismatch"] else 0))
                runs.append(r)
                print(f"  {engine}: wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s "
                      f"({r['cpu_us_per_record']:.2f} us/record), peak RSS {r['max_rss_mib']:.0f} MiB, "
                      f"exit {r['exit_status']}, {'correct' if r['correct'] else 'WRONG'}, "
                      f"load average {r['load_average'][0]}-{r['load_average'][1]}; {r['clean_judge']}", flush=True)
                if not r["correct"]:
                    print(r["stderr_tail"], file=sys.stderr)
            same = [r for r in runs if r["set"] == name]
            if len(same) >= 2:
                results[f"{name}_summaries_equal"] = all(r["summary"] == same[0]["summary"] for r in same)
            if "reference" in engines and len(engines) > 1:  # the whole JSON, byte for byte
                ref_json = (root / f"{name}-reference.json").read_bytes()
                results[f"{name}_json_equal"] = all((root / f"{name}-{e}.json").read_bytes() == ref_json
                                                    for e in engines if e != "reference")
            shutil.rmtree(root / name, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["runs"] = [{k: v for k, v in r.items() if k != "summary"} for r in runs]
    by = {(r["set"], r["engine"]): r for r in runs}
    ref = by.get(("subset", "reference")) or by.get(("full", "reference"))
    if ref:
        same_set = by[(ref["set"], "native")]
        results["per_core_speedup_same_data"] = ref["cpu_s"] / same_set["cpu_s"]
        results["wall_speedup_same_data"] = ref["wall_s"] / same_set["wall_s"]
        full = by[("full", "native")]
        results["per_core_speedup_per_record_full_vs_reference"] = ref["cpu_us_per_record"] / full["cpu_us_per_record"]
    table = Table(("set", "<7"), ("engine", "<13"), ("records", ">11,"), ("files", ">6"), ("wall s", ">8.1f"),
                  ("cpu s", ">8.1f"), ("us/rec", ">7.2f"), ("RSS MiB", ">8.0f"), ("ok", ">3"))
    print(table.header())
    for r in runs:
        print(table.row(r["set"], r["engine"], r["records"], r["files"], r["wall_s"], r["cpu_s"],
                        r["cpu_us_per_record"], r["max_rss_mib"], "yes" if r["correct"] else "NO"))
    for key in ("per_core_speedup_same_data", "wall_speedup_same_data", "per_core_speedup_per_record_full_vs_reference",
                "subset_summaries_equal", "full_summaries_equal", "subset_json_equal", "full_json_equal"):
        if key in results:
            print(f"{key}: {results[key]:.2f}" if isinstance(results[key], float) else f"{key}: {results[key]}")
    if args.out:
        write_result(args.out.parent, args.out.name, results)
    equal = all(v for k, v in results.items() if k.endswith(("_summaries_equal", "_json_equal")))
    return 0 if all(r["correct"] for r in runs) and equal else 1


if __name__ == "__main__":
    sys.exit(main())
