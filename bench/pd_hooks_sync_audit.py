"""Sync audit of the PD hook functions on a GPU: zero host-device syncs per room.

Runs the probe's real prefill and decode wrappers (dsv4_idxk_probe.sglang.
pd_prefill / pd_decode, as built by their factories) on stand-in scheduler,
queue and request objects that hold real CUDA tensors: DeepSeek-V4-shaped
index-K buffers (uint8 [pages, 8448] per C4 layer), an int32 req_to_token
table and CPU uint64 metadata rows, as SGLang 0.5.23 has them. SGLang itself
is not needed (nor imported).

Per room, in the order SGLang calls them:
  prefill  send_kv_chunk(last_chunk=True) -> [SGLang: set_buf, page list with a
           blocking .cpu() (the NIXL path), sender.send] -> CommonKVSender.send
  decode   _send_kv_metadata, _commit_transfer_to_req, process_batch_result_decode
           x step_interval, then once more with the request finished (decode_finish)
Only the probe's own work runs under torch.cuda.set_sync_debug_mode("error")
(plus tripwires on Event/Stream/device synchronize on the hook's thread, which that mode misses):
the stand-ins for SGLang's own code (which syncs on purpose, e.g. NIXL's
.cpu()) switch it off while they run. The probe catches its own exceptions
(fail-open), so a sync raised inside a hook shows up as a recorded probe
error; the audit fails on the first one and prints where it happened.
Also measured: caller-thread CPU time per room of each hook, and, after the
audit, that every room matched, that a flipped byte in a random (layer, page,
segment) is reported at decode_recv with exactly that cell, and that a byte
changed after receipt is first reported at decode_step with decode_recv a
match.

Usage (needs CUDA):  python -m bench.pd_hooks_sync_audit [--rooms 64] [--out DIR]
Exit status 0 when every check passed. Missing optional modules on the GPU
box (prometheus_client, xxhash, pyyaml, pyzmq) are replaced by inert
stand-ins, announced on stderr: metrics go to a no-op object, the exchange
is replaced by an in-process lookup of the prefill table.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import platform
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace

from bench.harness import Table, median_us, percentile, write_result

PAGE = 256
SLOTS = 64
ROW = SLOTS * 132  # fp8 index-K row: 64 x 128 B payload + 64 x 4 B scale


# %% optional modules the probe imports at module level


def _standin_modules() -> list[str]:
    """Inert stand-ins for modules this box lacks (never used by the audit's code paths)."""
    missing = []
    if importlib.util.find_spec("prometheus_client") is None:
        mod = types.ModuleType("prometheus_client")

        class _Metric:
            def __init__(self, *a, **k):
                pass

            def labels(self, **k):
                return self

            def inc(self, *a):
                pass

            def observe(self, *a):
                pass

            def set(self, *a):
                pass

        mod.Counter = mod.Gauge = mod.Histogram = _Metric
        mod.CollectorRegistry = object
        mod.REGISTRY = object()
        mod.start_http_server = None
        sys.modules["prometheus_client"] = mod
        missing.append("prometheus_client")
    if importlib.util.find_spec("xxhash") is None:
        import hashlib

        mod = types.ModuleType("xxhash")
        mod.xxh3_64_intdigest = lambda data: int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        sys.modules["xxhash"] = mod
        missing.append("xxhash")
    if importlib.util.find_spec("yaml") is None:
        mod = types.ModuleType("yaml")
        mod.YAMLError = ValueError
        mod.SafeLoader = object

        def safe_load(_text):
            raise ValueError("pyyaml is not installed on this machine")

        mod.safe_load = safe_load
        sys.modules["yaml"] = mod
        missing.append("yaml")
    return missing


STANDINS = _standin_modules()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dsv4_idxk_probe import safety  # noqa: E402
from dsv4_idxk_probe.config import parse_config  # noqa: E402
from dsv4_idxk_probe.digest import RoomRequest  # noqa: E402
from dsv4_idxk_probe.digest.layout import RowLayout, Segment  # noqa: E402
from dsv4_idxk_probe.runtime import Runtime  # noqa: E402
from dsv4_idxk_probe.sglang import pd_decode, pd_prefill  # noqa: E402
from dsv4_idxk_probe.sglang.index_k import index_k_geometry  # noqa: E402
from dsv4_idxk_probe.sglang.sides import DecodeSide, PrefillSide  # noqa: E402

FP8 = RowLayout("fp8", SLOTS, 4, (Segment("payload", 0, 128), Segment("scale", SLOTS * 128, 4)), ROW)


class NullMetrics:
    """Accepts every metric call (the audit counts errors through safety.error_counts)."""

    def __getattr__(self, name):
        return self

    def __call__(self, *_, **__):
        return self

    def labels(self, **_):
        return self

    def inc(self, *_):
        pass

    def observe(self, *_):
        pass

    def set(self, *_):
        pass


class Sink:
    def __init__(self):
        self.records: list[dict] = []

    def __call__(self, record):
        self.records.append(record)

    def wait(self, n: int, timeout: float = 60.0, **match) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            got = [r for r in list(self.records) if all(r.get(k) == v for k, v in match.items())]
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.01)


class FirstError(logging.Handler):
    """Keeps the first probe failure the fail-open boundary logged (with its traceback)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.first: str | None = None

    def emit(self, record):
        if self.first is None:
            self.first = self.format(record)


def _set_sync_mode(mode) -> None:
    SyncGuard.armed = mode == "error"
    SyncGuard.armed_thread = threading.get_ident() if SyncGuard.armed else None
    if SyncGuard.active:
        torch.cuda.set_sync_debug_mode(mode)


def _tripwire(owner, name: str) -> None:
    """set_sync_debug_mode sees blocking copies and stream syncs, not event or device
    synchronize: those raise too while a hook runs, on the hook's thread (the
    probe's collector thread waits on its events by design)."""
    original = getattr(owner, name)

    def call(*args, **kwargs):
        if SyncGuard.armed and SyncGuard.armed_thread == threading.get_ident():
            raise RuntimeError(f"{getattr(owner, '__name__', owner)}.{name}() called inside a hook")
        return original(*args, **kwargs)

    setattr(owner, name, call)


for _owner, _name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")):
    _tripwire(_owner, _name)


class SyncGuard:
    """set_sync_debug_mode("error") for the probe's code, off for SGLang's stand-in code.
    Inactive with --cpu-smoke (no CUDA: checks the logic, not the syncs)."""

    active = True
    armed = False
    armed_thread: int | None = None  # the thread running the hook

    def __enter__(self):
        _set_sync_mode("error")
        return self

    def __exit__(self, *exc):
        _set_sync_mode(0)

    @staticmethod
    def host_code(fn):
        def run(*args, **kwargs):
            previous = "error" if SyncGuard.armed else 0
            _set_sync_mode(0)
            try:
                return fn(*args, **kwargs)
            finally:
                _set_sync_mode(previous)

        return run


# %% stand-in SGLang objects holding real CUDA tensors


def make_pool(n_layers: int, n_pages: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    buffers = [torch.randint(0, 256, (n_pages, ROW), dtype=torch.uint8, device=device, generator=g) for _ in range(n_layers)]
    indexer = SimpleNamespace(page_size=SLOTS, index_k_with_scale_buffer=buffers, use_fp4_indexer=False,
                              contiguous_page_row_buffers=lambda: buffers)
    ratios = [4 if i % 2 == 0 else 128 for i in range(2 * n_layers)]  # C4 layers: 0, 2, 4, ...
    return SimpleNamespace(index_pools={4: indexer}, compression_ratios=ratios, page_size=PAGE,
                           _stage_start=0, _stage_end=len(ratios)), buffers


def make_scheduler(pool, rooms: int, max_tokens: int, device):
    allocator = SimpleNamespace(page_size=PAGE, get_kvcache=lambda: pool, translate_kv_indices_for_transfer=lambda x: x)
    metadata = SimpleNamespace(bootstrap_room=torch.zeros((rooms + 1, 8), dtype=torch.uint64))
    return SimpleNamespace(
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros((rooms + 1, max_tokens), dtype=torch.int32, device=device)),
        disagg_metadata_buffers=metadata,
        metadata_buffers=metadata,
    )


def assign_pages(scheduler, row: int, pages: list[int], n_tokens: int, device) -> None:
    locs = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int32, device=device) for p in pages])
    scheduler.req_to_token_pool.req_to_token[row, :n_tokens] = locs[:n_tokens]


def runtime_for(mode: str = "observe", step_interval: int = 4, diagnosis: bool = False) -> tuple[Runtime, Sink]:
    sink = Sink()
    config = parse_config({"mode": mode, "step_interval": step_interval, "exchange": {"enabled": False},
                           "diagnosis": {"enabled": diagnosis}}, "<bench>")
    return Runtime(config, metrics=NullMetrics(), emit=sink), sink


# %% one room through the hooks


class Timer:
    def __init__(self):
        self.total: dict[str, list[float]] = {}

    def run(self, name: str, fn, *args, host_seconds: list | None = None):
        started = time.thread_time()
        result = fn(*args)
        spent = time.thread_time() - started - (sum(host_seconds) if host_seconds else 0.0)
        self.total.setdefault(name, []).append(spent)
        if host_seconds is not None:
            host_seconds.clear()
        return result


def prefill_room(wrappers, prefill, room: int, row: int, n_tokens: int, timer: Timer):
    send_kv_chunk, sender_send = wrappers
    host_seconds: list[float] = []
    sender = SimpleNamespace(curr_idx=0, num_kv_indices=-(-n_tokens // PAGE), conclude_state=None)
    req = SimpleNamespace(
        rid=f"bench-{room}", bootstrap_room=room, bootstrap_host="10.0.0.1", disagg_decode_prefix_len=0,
        extend_end=n_tokens, origin_input_ids=range(n_tokens), kv=SimpleNamespace(req_pool_idx=row),
        metadata_buffer_index=row, finished_reason=None, pending_bootstrap=False, prefill_attempt_count=0,
        disagg_kv_sender=sender,
    )

    @SyncGuard.host_code
    def sglang_send_kv_chunk(req, last_chunk=False, end_idx=None):
        """SGLang's _send_kv_chunk on the NIXL path: set_buf, a blocking page list, sender.send."""
        t0 = time.thread_time()
        prefill.metadata_buffers.bootstrap_room[row, 0] = room
        rows = prefill.req_to_token_pool.req_to_token[row, :n_tokens]
        page_indices = (rows[::PAGE] // PAGE).cpu().numpy().astype(np.int32)  # kv_to_page_indices: blocks
        host_seconds.append(time.thread_time() - t0)
        _set_sync_mode("error")
        sender_send(lambda *a, **k: None, sender, (page_indices,), {})
        _set_sync_mode(0)

    with SyncGuard():
        timer.run("prefill send_kv_chunk + sender.send", send_kv_chunk, sglang_send_kv_chunk, prefill, (req,),
                  {"last_chunk": True}, host_seconds=host_seconds)
    return req


def decode_room(wrappers, decode, prefill_meta_row, room: int, row: int, n_tokens: int, steps: int, timer: Timer):
    send_metadata, commit, step = wrappers[:3]
    req = SimpleNamespace(rid=f"bench-{room}", bootstrap_room=room, bootstrap_host="10.0.0.1", finished_reason=None)
    req.finished = lambda: req.finished_reason is not None
    dreq = SimpleNamespace(req=req, metadata_buffer_index=row, kv_receiver=SimpleNamespace(bootstrap_infos=[]))
    queue = SimpleNamespace(scheduler=decode)
    kv_indices = decode.req_to_token_pool.req_to_token[row, :n_tokens]
    with SyncGuard():
        timer.run("decode _send_kv_metadata", send_metadata, lambda *a, **k: None, queue,
                  (dreq, kv_indices, PAGE, None), {"decode_prefix_len": 0})
    decode.metadata_buffers.bootstrap_room[row].copy_(prefill_meta_row)  # the aux transfer

    def sglang_commit(decode_req):
        decode_req.kv_receiver = None

    transfer_queue = SimpleNamespace(scheduler=decode, metadata_buffers=decode.metadata_buffers)
    with SyncGuard():
        timer.run("decode _commit_transfer_to_req", commit, sglang_commit, transfer_queue, (dreq,), {})
    batch = SimpleNamespace(reqs=[req])
    for _ in range(steps):
        with SyncGuard():
            timer.run("decode process_batch_result_decode", step, lambda *a, **k: None, None, (batch, None), {})
    return req, batch


def finish_room(step_wrapper, release_wrapper, req, batch, timer: Timer):
    """As SGLang finishes a room: release_kv_cache inside the batch's result processing
    (the probe's finish digest, before the free), then the batch hook after it."""
    req.finished_reason = "length"
    with SyncGuard():
        timer.run("decode release_kv_cache (finish)", release_wrapper, lambda *a, **k: None, None, (req, None), {})
        timer.run("decode process_batch_result_decode (finish)", step_wrapper, lambda *a, **k: None, None,
                  (batch, None), {})


# %% the audit


def _brief(records: list[dict]) -> list[dict]:
    keys = ("room", "stage", "verdict", "reason", "localisation", "first_divergence")
    return [{k: r.get(k) for k in keys} for r in records[:1]]


def _stream(stream):
    """SGLang's scheduler loop runs on its own schedule_stream."""
    import contextlib

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30, help="C4 layers (DeepSeek-V4: 30)")
    parser.add_argument("--pages", type=int, default=4096, help="physical pages per pool")
    parser.add_argument("--room-tokens", type=int, default=16 * PAGE + 100, help="tokens per room (partial tail page)")
    parser.add_argument("--faults", type=int, default=8, help="flipped-byte rooms to localise")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--diagnosis", action="store_true", help="diagnosis on (docs/diagnosis.md): its hooks are audited too")
    parser.add_argument("--cpu-smoke", action="store_true", help="no GPU: run the flow on CPU tensors (no sync audit)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        SyncGuard.active = False
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    for name in STANDINS:
        print(f"note: {name} is not installed here; an inert stand-in is used", file=sys.stderr)
    first_error = FirstError()
    logging.getLogger("dsv4_idxk_probe").addHandler(first_error)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(int(time.time()))
    n_tokens = args.room_tokens
    pages_per_room = -(-n_tokens // PAGE)
    total_rooms = args.rooms + args.faults + 1
    assert total_rooms * pages_per_room < args.pages, "--pages too small for the rooms asked"

    runtime, sink = runtime_for(diagnosis=args.diagnosis)
    pre_pool, pre_bufs = make_pool(args.layers, args.pages, device, seed=1)
    dec_pool, dec_bufs = make_pool(args.layers, args.pages, device, seed=2)
    prefill = make_scheduler(pre_pool, total_rooms, pages_per_room * PAGE, device)
    decode = make_scheduler(dec_pool, total_rooms, pages_per_room * PAGE, device)
    pre_side = PrefillSide(runtime, index_k_geometry(pre_pool), FP8, host=None, gpu_id=0)
    dec_side = DecodeSide(runtime, index_k_geometry(dec_pool), FP8)
    dec_side.monitor.fetch_vectors = pre_side.monitor.lookup  # the exchange, in process
    runtime.attach("prefill", pre_side)
    runtime.attach("decode", dec_side)
    pre_wrappers = (pd_prefill.make_send_kv_chunk_wrapper(runtime), pd_prefill.make_sender_send_wrapper(runtime))
    dec_wrappers = (pd_decode.make_send_kv_metadata_wrapper(runtime), pd_decode.make_commit_transfer_wrapper(runtime),
                    pd_decode.make_decode_step_wrapper(runtime), pd_decode.make_release_wrapper(runtime))

    perm_pre = rng.permutation(args.pages - 1)[: total_rooms * pages_per_room] + 1
    perm_dec = rng.permutation(args.pages - 1)[: total_rooms * pages_per_room] + 1
    layout_of = {}
    for i in range(total_rooms):
        p = [int(x) for x in perm_pre[i * pages_per_room : (i + 1) * pages_per_room]]
        d = [int(x) for x in perm_dec[i * pages_per_room : (i + 1) * pages_per_room]]
        assign_pages(prefill, i + 1, p, n_tokens, device)
        assign_pages(decode, i + 1, d, n_tokens, device)
        for src, dst in zip(pre_bufs, dec_bufs):
            dst[d] = src[p]  # the transfer
        layout_of[i] = (p, d)
    for side in (pre_side, dec_side):  # compile the kernel outside the audit (one-time, not per room)
        side.engine.digest_now([RoomRequest("warm-up/0", torch.arange(1, 3, device=device), 2 * PAGE)])
    synchronize()

    schedule_stream = torch.cuda.Stream() if device.type == "cuda" else None
    timer = Timer()
    failures: list[str] = []
    errors_before = sum(safety.error_counts().values())
    warm = 4  # first rooms pay one-time costs (Triton compile, allocator growth): timed separately
    with _stream(schedule_stream):
        live = []
        for i in range(args.rooms):
            room = 1000 + i
            req = prefill_room(pre_wrappers, prefill, room, i + 1, n_tokens, timer if i >= warm else Timer())
            if sum(safety.error_counts().values()) != errors_before:
                failures.append(f"prefill room {room}: the probe failed (a sync?):\n{first_error.first}")
                break
            live.append(decode_room(dec_wrappers, decode, prefill.metadata_buffers.bootstrap_room[i + 1], room, i + 1,
                                    n_tokens, runtime.config.step_interval, timer if i >= warm else Timer()))
            if sum(safety.error_counts().values()) != errors_before:
                failures.append(f"decode room {room}: the probe failed (a sync?):\n{first_error.first}")
                break
            del req
        for req, batch in live:
            finish_room(dec_wrappers[2], dec_wrappers[3], req, batch, timer)
    if sum(safety.error_counts().values()) != errors_before and not failures:
        failures.append(f"the probe failed (a sync?):\n{first_error.first}")

    # every room verified at every stage, all matching
    n = len(live)
    for stage in ("decode_recv", "decode_step", "decode_finish"):
        got = sink.wait(n, stage=stage)
        bad = [r for r in got if r["verdict"] != "match"]
        if len(got) < n or bad:
            failures.append(f"{stage}: {len(got)}/{n} records, {len(bad)} not match: {_brief(bad)}")

    # a flipped byte in a random cell, reported at decode_recv with exactly that cell
    localised = []
    segments = {"payload": (0, 128), "scale": (SLOTS * 128, 4)}
    for k in range(args.faults):
        i = args.rooms + k
        room = 5000 + k
        layer = int(rng.integers(args.layers))
        page = int(rng.integers(pages_per_room))
        segment = ["payload", "scale"][int(rng.integers(2))]
        frozen = SLOTS if page < pages_per_room - 1 else (n_tokens - page * PAGE) // 4
        base, width = segments[segment]
        offset = base + int(rng.integers(frozen)) * width + int(rng.integers(width))
        with _stream(schedule_stream):
            prefill_room(pre_wrappers, prefill, room, i + 1, n_tokens, Timer())
            synchronize()
            dec_bufs[layer][layout_of[i][1][page], offset] ^= 1 << int(rng.integers(8))
            decode_room(dec_wrappers, decode, prefill.metadata_buffers.bootstrap_room[i + 1], room, i + 1, n_tokens, 0, Timer())
        got = sink.wait(1, stage="decode_recv", room=str(room))
        loc = got[0]["localisation"] if got else None
        expected = {"layer_segments": [[2 * layer, segment]], "pages": [page]}
        ok = bool(got) and got[0]["verdict"] == "mismatch" and loc and all(loc[key] == v for key, v in expected.items())
        localised.append({"room": room, "expected": expected, "got": loc, "ok": ok})
        if not ok:
            failures.append(f"fault room {room}: expected {expected}, got {_brief(got)}")

    # a byte changed after receipt: decode_recv match, first seen at decode_step
    i = total_rooms - 1
    room = 9000
    with _stream(schedule_stream):
        prefill_room(pre_wrappers, prefill, room, i + 1, n_tokens, Timer())
        req, batch = decode_room(dec_wrappers, decode, prefill.metadata_buffers.bootstrap_room[i + 1], room, i + 1,
                                 n_tokens, 0, Timer())
        recv = sink.wait(1, stage="decode_recv", room=str(room))
        dec_bufs[-1][layout_of[i][1][1], 4096] ^= 0x20  # last C4 layer, logical page 1, payload
        for _ in range(runtime.config.step_interval):
            dec_wrappers[2](lambda *a, **k: None, None, (batch, None), {})
    step = sink.wait(1, stage="decode_step", room=str(room))
    after_ok = (recv and recv[0]["verdict"] == "match" and step and step[0]["verdict"] == "mismatch"
                and step[0]["first_divergence"] == "decode_step"
                and step[0]["localisation"]["layer_segments"] == [[2 * (args.layers - 1), "payload"]]
                and step[0]["localisation"]["pages"] == [1])
    if not after_ok:
        failures.append(f"after-receipt change: recv {_brief(recv)}, step {_brief(step)}")

    runtime.close()
    cpu_us = {name: {"median_us": median_us(v), "p90_us": 1e6 * percentile(v, 90), "calls": len(v)}
              for name, v in timer.total.items()}
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: no sync audit)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "standins": STANDINS,
        "rooms": n, "layers": args.layers, "room_tokens": n_tokens, "pages_per_room": pages_per_room,
        "probe_errors": sum(safety.error_counts().values()) - errors_before,
        "cpu_per_call": cpu_us,
        "faults_localised": sum(x["ok"] for x in localised), "faults": len(localised),
        "after_receipt_change_ok": bool(after_ok),
        "failures": failures,
    }
    table = Table(("hook (caller CPU time, probe only)", "<44"), ("median us", ">10.1f"), ("p90 us", ">9.1f"), ("calls", ">6"))
    print(table.header())
    for name, v in cpu_us.items():
        print(table.row(name, v["median_us"], v["p90_us"], v["calls"]))
    print(f"rooms {n} x {args.layers} C4 layers x {pages_per_room} pages; syncs added by the hooks: "
          f"{'none' if not failures else 'see failures'}; faults localised {result['faults_localised']}/{len(localised)}; "
          f"after-receipt change {'ok' if after_ok else 'FAILED'}")
    for f in failures:
        print("FAIL:", f)
    if args.out is not None:
        write_result(args.out, "pd_hooks_sync_audit.json", result, indent=2)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
