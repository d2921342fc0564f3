"""Requests SGLang's router lost before decode ever saw them (docs/rig.md, "Requests without
an answer").

Why: in PD mode the router sends each request to prefill and decode at once. Seen in a
fresh-clone run (2026-12-06, the abort phase of the normal loops): the decode leg never
reached decode's server (the router logged "Decode request failed ... error sending
request" when the client gave up), so prefill waited in ``KVPoll.Bootstrapping`` for a
decode that never came, until its 300 s timeout, and the client got no answer. No probe
code runs for such a request on either side: decode never had it, prefill never sent it.
A phase resends such a request once, under a new rid, and names it (`Phase.router_lost`),
instead of failing a test on SGLang's router.

The signature, all of it: the client timed out without an answer; prefill's log says the
rid's bootstrap timed out in ``KVPoll.Bootstrapping``; decode's log never names the rid.
"""

from __future__ import annotations

import time
from pathlib import Path

from .workload import Outcome

#: How long to wait for prefill's log line (its timeout and the client's end together).
PREFILL_LINE_WAIT_S = 30.0


def _names(text: str, rid: str) -> bool:
    return f"rid='{rid}'" in text or f'rid="{rid}"' in text


def bootstrap_timed_out(prefill_log: str, rid: str) -> bool:
    """Whether prefill's log says `rid`'s bootstrap timed out waiting for decode."""
    return any(_names(line, rid) and "timed out" in line and "KVPoll.Bootstrapping" in line
               for line in prefill_log.splitlines())


def lost_before_decode(outcome: Outcome, prefill_log: Path, decode_log: Path,
                       wait_s: float = PREFILL_LINE_WAIT_S) -> bool:
    """Whether `outcome` is a request the router lost on its way to decode (the signature above)."""
    request = outcome.request
    if request.aborted or outcome.status is not None or "timed out" not in outcome.error:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        if bootstrap_timed_out(_read(prefill_log), request.rid):
            return not _names(_read(decode_log), request.rid)
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
