"""Requests for the rig: a seeded plan, sent through SGLang's router.

Each request carries its own ``rid`` (``<run>-<number>``), so the rig's
in-server parts can tell which planned request a room is, and ``input_ids``
(the servers run without a tokenizer). A share of the prompts repeat an
earlier prompt's first pages, so the radix caches of prefill (early send of a
cached prefix) and decode (``cache_protected_len``) see hits.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .launch import PAGE_SIZE, VOCAB


@dataclass(frozen=True)
class Request:
    number: int  # the rig's room number, 1..N (what fault specs name)
    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    abort_after_s: float | None = None  # the client hangs up after this long (an abort)
    # or when this `threading.Event` is set: an abort at a moment the test picks
    hang_up: threading.Event | None = field(default=None, compare=False)

    @property
    def aborted(self) -> bool:
        """Whether the client means to hang up before the answer (its status is not judged)."""
        return self.abort_after_s is not None or self.hang_up is not None


@dataclass(frozen=True)
class WorkloadOptions:
    rooms: int = 64
    seed: int = 0
    min_prompt: int = 600
    max_prompt: int = 2900
    min_new_tokens: int = 8
    max_new_tokens: int = 40
    shared_prefix_share: float = 0.25  # of the prompts, repeat an earlier prompt's first pages
    concurrency: int = 4
    aborts: tuple[int, ...] = ()  # room numbers whose client disconnects early
    # rooms whose prompts no later prompt repeats: a fault that changes a room's pages in
    # prefill's memory (`before_send`) would otherwise reach the rooms that share them
    # through prefill's radix cache, on both sides alike (`prefill_fault_rooms`)
    private: tuple[int, ...] = ()
    # rooms that must stay resident on decode while others arrive (a swap_pages fault needs a
    # partner room there): they generate `long_new_tokens` each (`fault_workload`)
    long_rooms: tuple[int, ...] = ()
    long_new_tokens: int = 160


def plan(run: str, opts: WorkloadOptions) -> list[Request]:
    rng = np.random.default_rng([opts.seed, 0x5617])
    out: list[Request] = []
    for n in range(1, opts.rooms + 1):
        length = int(rng.integers(opts.min_prompt, opts.max_prompt + 1))
        ids = rng.integers(2, VOCAB, size=length).tolist()
        donors = [r for r in out if r.number not in opts.private] if opts.private else out
        if donors and rng.random() < opts.shared_prefix_share:
            donor = donors[int(rng.integers(len(donors)))].input_ids
            keep = min(len(donor), length) // PAGE_SIZE * PAGE_SIZE
            if n not in opts.private:  # a private room takes no one's pages either
                ids[:keep] = donor[:keep]
        steps = int(rng.integers(opts.min_new_tokens, opts.max_new_tokens + 1))
        if n in opts.long_rooms:
            steps = max(steps, opts.long_new_tokens)
        abort = 0.05 if n in opts.aborts else None
        out.append(Request(n, f"{run}-{n}", tuple(int(i) for i in ids), steps, abort))
    return out


@dataclass
class Outcome:
    request: Request
    status: int | None = None
    output_ids: list[int] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0


def send(url: str, requests: list[Request], concurrency: int, *, timeout_s: float = 300.0,
         on_done=None) -> list[Outcome]:
    """POST every request to ``url/generate``, `concurrency` at a time; one Outcome each."""
    lock = threading.Lock()

    def one(req: Request) -> Outcome:
        body = {
            "rid": req.rid, "input_ids": list(req.input_ids),
            "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        outcome = Outcome(req)
        started = time.monotonic()
        post = _post if req.hang_up is None else _post_until_hung_up
        post(url, body, req, timeout_s, outcome)
        outcome.seconds = time.monotonic() - started
        if on_done is not None:
            with lock:
                on_done(outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, requests))


def _answered(outcome: Outcome, status: int, payload: bytes) -> None:
    outcome.status = status
    outcome.output_ids = list(json.loads(payload).get("output_ids") or [])


def _post(url: str, body: dict, req: Request, timeout_s: float, outcome: Outcome) -> None:
    """POST `body` to ``url/generate``; the client hangs up after `req.abort_after_s`, if set."""
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=req.abort_after_s or timeout_s) as resp:
            _answered(outcome, resp.status, resp.read())
    except urllib.error.HTTPError as exc:
        outcome.status = exc.code
        outcome.error = exc.read()[:300].decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"


def _post_until_hung_up(url: str, body: dict, req: Request, timeout_s: float, outcome: Outcome) -> None:
    """POST `body` to ``url/generate`` and wait for the answer; once `req.hang_up` is set, close
    the connection (the router and the servers see the client go: an abort)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    answered = threading.Event()

    def close_when_told() -> None:
        while not req.hang_up.wait(0.2):
            if answered.is_set():
                return
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):
            pass  # answered, or never connected

    closer = threading.Thread(target=close_when_told, name="rig-hang-up", daemon=True)
    try:
        conn.request("POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        closer.start()
        resp = conn.getresponse()
        _answered(outcome, resp.status, resp.read())
    except (OSError, ValueError, http.client.HTTPException) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        answered.set()
        conn.close()


def prefill_fault_rooms(fault_spec_path) -> tuple[int, ...]:
    """The rooms a fault spec changes in prefill's memory (`before_send`), named by number
    (a fraction of rooms is drawn in the servers and cannot be known here): the rooms to
    keep `private` so no other room shares their pages."""
    return _rooms_of(fault_spec_path, lambda f: f.when == "before_send")


def swap_fault_rooms(fault_spec_path) -> tuple[int, ...]:
    """The rooms whose fault swaps pages with another resident room: kept `long_rooms`, so
    rooms sent after them reach decode while they still decode (a short room can come and
    go alone, and its swap would find no partner; the rig also slows a waiting swap's room,
    `hooks.SWAP_WAIT_PAUSE_S`)."""
    from ..faults.spec import load_fault_spec

    swaps = [f for f in load_fault_spec(fault_spec_path).faults if f.kind == "swap_pages"]
    return tuple(sorted({r for f in swaps for r in (f.room_ids or ())} | {f.with_room for f in swaps if f.with_room}))


def fault_workload(fault_spec_path, **options) -> WorkloadOptions:
    """WorkloadOptions for a run with this fault spec: its prefill-side rooms private, its
    swap rooms long."""
    return WorkloadOptions(private=prefill_fault_rooms(fault_spec_path),
                           long_rooms=swap_fault_rooms(fault_spec_path), **options)


def _rooms_of(fault_spec_path, wanted) -> tuple[int, ...]:
    from ..faults.spec import load_fault_spec

    spec = load_fault_spec(fault_spec_path)
    return tuple(sorted({room for f in spec.faults if wanted(f) for room in (f.room_ids or ())}))

