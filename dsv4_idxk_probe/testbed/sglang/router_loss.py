"""Requests SGLang's router lost on one of its two legs (docs/rig.md, "Requests without an
answer").

Why: in PD mode the router sends each request to prefill and decode at once, and a leg whose
connection fails after the request left tells the other side nothing. Seen in fresh-clone
runs (2026-12-06): the decode leg never reached decode's server (the router logged "Decode
request failed ... error sending request" when the client gave up), so prefill waited in
``KVPoll.Bootstrapping`` for a decode that never came, until its 300 s timeout; and the
prefill leg never reached prefill's server, so decode waited in ``KVPoll.WaitingForInput``
for a transfer that never came (shown with the probe off: ``bench.router_prefill_loss``).
The client got no answer either way. No probe code runs for such a request on the side that
never had it, and the other side never receives its KV. A phase resends such a request once,
under a new rid, and names it (`Phase.router_lost`), instead of failing a test on SGLang's
router.

The signature, all of it: the client timed out without an answer; one side's log says the
rid timed out in the state that waits for the other (prefill: ``KVPoll.Bootstrapping``;
decode: ``KVPoll.WaitingForInput``); the other side's log never names the rid.
"""

from __future__ import annotations

import time
from pathlib import Path

from .workload import Outcome

#: How long to wait for the waiting side's log line (its timeout and the client's end together).
WAITING_LINE_WAIT_S = 30.0


def _names(text: str, rid: str) -> bool:
    return f"rid='{rid}'" in text or f'rid="{rid}"' in text


#: (the side that waited, the state it timed out in, the side whose leg was lost)
_SIGNATURES = (("prefill", "KVPoll.Bootstrapping", "decode"), ("decode", "KVPoll.WaitingForInput", "prefill"))


def waited_in_vain(log: str, rid: str, state: str) -> bool:
    """Whether a side's log says `rid` timed out in `state`, waiting for the other side."""
    return any(_names(line, rid) and "timed out" in line and state in line for line in log.splitlines())


def lost_by_router(outcome: Outcome, prefill_log: Path, decode_log: Path,
                   wait_s: float = WAITING_LINE_WAIT_S) -> bool:
    """Whether `outcome` is a request the router lost on one leg (the signature above)."""
    request = outcome.request
    if request.aborted or outcome.status is not None or "timed out" not in outcome.error:
        return False
    logs = {"prefill": prefill_log, "decode": decode_log}
    deadline = time.monotonic() + wait_s
    while True:
        for waited, state, lost in _SIGNATURES:
            if waited_in_vain(_read(logs[waited]), request.rid, state):
                return not _names(_read(logs[lost]), request.rid)
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
