"""Decode side: ask a prefill rank for a room's vectors, with a deadline.

One idle TCP connection per peer, authenticated once (`auth`) and reused; a
request takes it out of the table while it runs (two at once to one peer open a
second, closed after), so a silent peer holds up only the threads asking it. A
request not answered in `timeout_ms` closes that connection (so a late answer
is never mistaken for a later request's) and marks the peer down: requests to
it return None at once until then. The first failure marks it down for
`backoff_initial_s`, each further one in a row for twice as long, up to
`backoff_s`; any answer resets it (one slow answer from a busy prefill rank
costs a quarter of a second, not five). A peer that failed authentication is
left alone for `backoff_s` at once. A peer that turned the connection away
for load before the handshake was done (`auth.BUSY`: a flood, or more peers
than it takes) counts as ``busy``, never as ``auth``, and is left alone like
one that timed out: `backoff_initial_s` first. `fetch(..., retry_s=...)`
waits out a short backoff and asks again, while `retry_s` from its first try
allows it and the peer has not failed 3 times in a row (decode's collector
does, for the rooms it must localise; never the scheduler thread). A peer
that closed an idle connection is asked again on a fresh one. Every failure
is counted in ``exchange_errors_total{kind}``; `fetch` never raises.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

from ..digest.result import RoomDigest
from . import auth
from .protocol import ExchangeError, decode_response, encode_request
from .stages import StageEndpoints, combine_stage_digests

log = logging.getLogger("dsv4_idxk_probe.exchange")

Endpoint = tuple[str, int]
RETRIED = frozenset(("timeout", "busy", "peer_down", "not_found"))  # failures `fetch(retry_s=...)` asks again after
WAITED_STRIKES = 3  # a peer that failed this many times in a row is no longer waited for
#: Threads asking the stages of rooms served by several prefill PP stages, beyond each caller's
#: own: made as needed, up to enough for decode's 8 prefetch workers and its collectors with 8
#: stages each. A stage request that waits for one past its room's time is not sent (`late`).
STAGE_WORKERS = 64
# Peers a client keeps state for (open sessions, backoffs, warnings), each table apart; past
# it the least recently added (sessions: used) goes. Prefill endpoints change with every
# restart, so a long-lived decode would otherwise keep one entry (and a socket) per old one.
MAX_PEERS = 1024
#: The failures `_fail` counts, each created at zero with a client that has metrics (so that
#: an alert's `increase()` sees the first of each kind, as the server's SERVER_KINDS).
CLIENT_KINDS = ("no_endpoint", "auth", "peer_down", "timeout", "busy", "not_found", "protocol", "transport",
                "internal", "late")


class _Deadline(Exception):
    """The request's time is up."""


class _Refused(Exception):
    """The peer failed authentication or broke the framing."""


class _Closed(Exception):
    """The peer closed the connection."""


class _Busy(Exception):
    """The peer turned the connection away for load before the handshake was done (`auth.BUSY`)."""


class _Session:
    def __init__(self, sock: socket.socket, mac: auth.FrameMac):
        self.sock = sock
        self.mac = mac


class VectorClient:
    def __init__(
        self,
        *,
        timeout_ms: int = 200,
        backoff_s: float = 5.0,
        backoff_initial_s: float = 0.25,
        metrics: Any = None,
        max_response_bytes: int = 16 << 20,
        secret: bytes | None = None,
        secret_file: str | None = None,
    ):
        self.timeout_ms = int(timeout_ms)
        self.backoff_s = float(backoff_s)
        self.backoff_initial_s = min(float(backoff_initial_s), self.backoff_s)
        self.metrics = metrics
        self.max_response_bytes = int(max_response_bytes)
        self._secret_error: str | None = None
        if secret is None and secret_file:
            try:
                secret = auth.load_secret(secret_file)
            except auth.SecretError as exc:
                self._secret_error = str(exc)
                log.error("dsv4-idxk-probe exchange client has no secret, no vectors will be fetched: %s", exc)
        self.secret = secret or b""
        self._sessions: dict[Endpoint, _Session] = {}
        self._down_until: dict[Endpoint, float] = {}
        self._strikes: dict[Endpoint, int] = {}  # failures in a row per peer (the backoff doubles with each)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the tables only: no request runs under it
        self._warned_auth: dict[Endpoint, None] = {}  # peers whose refusal was logged (once each)
        self._closed = False
        self._stage_workers: ThreadPoolExecutor | None = None  # made at the first room of several stages
        self.failures: dict[str, int] = {}
        for kind in CLIENT_KINDS if metrics is not None else ():
            self._count(kind, 0)

    @classmethod
    def from_config(cls, exchange: Any, metrics: Any = None) -> "VectorClient":
        """A client set up by the probe config's `exchange` section (what every decode side builds)."""
        return cls(timeout_ms=exchange.timeout_ms, backoff_s=exchange.backoff_s,
                   backoff_initial_s=exchange.backoff_initial_s, metrics=metrics, secret_file=exchange.secret_file)

    def fetch(self, endpoint: Endpoint | None, key: str, *, retry_s: float = 0.0,
              until: float | None = None) -> RoomDigest | None:
        """The peer's digest of room `key`, or None (unknown peer or room, timeout, bad answer).

        `retry_s` > 0: after a timeout or a skipped peer, wait for the peer's backoff to
        end and ask again, as long as that is within `retry_s` of the first try and the
        peer has not failed `WAITED_STRIKES` times in a row (a dead peer is waited for
        once, not per room); after "no such room", ask once more `backoff_initial_s`
        later (prefill may not have published it yet).

        `until`: a `time.monotonic()` past which nothing is asked and no request waits (a PP
        stage's share of its room's time); reached before an answer, the fetch counts `late`."""
        if isinstance(endpoint, StageEndpoints):  # prefill PP: every stage serves its own layers
            try:
                return self._fetch_stages(endpoint, key, retry_s)
            except Exception:  # as below: a bug here costs one room's localisation, never the caller
                log.debug("exchange fetch of %s from its stages failed", key, exc_info=True)
                self._fail("internal")
                return None
        give_up = time.monotonic() + max(0.0, float(retry_s))
        asked_again_for_room = False
        while True:
            if until is not None and time.monotonic() >= until:
                self._fail("late")
                return None
            try:
                digest, failure = self._fetch(endpoint, key, until)
            except Exception:  # the docstring's promise: a bug here costs one room's localisation
                log.debug("exchange fetch of %s failed", key, exc_info=True)
                self._fail("internal")
                return None
            if digest is not None or failure not in RETRIED:
                return digest
            if failure == "not_found":
                if asked_again_for_room:
                    return None
                asked_again_for_room, wait = True, self.backoff_initial_s
            elif self._strikes_of(endpoint) >= WAITED_STRIKES:
                return None
            else:
                wait = self.backoff_left(endpoint)
            if time.monotonic() + wait > (give_up if until is None else min(give_up, until)):
                return None
            time.sleep(wait)

    def _fetch_stages(self, stages: StageEndpoints, key: str, retry_s: float) -> RoomDigest | None:
        """Every PP stage's digest of room `key`, combined (exchange/stages.py); None when a stage has none.

        The stages are asked at once (the first on this thread, the others on the client's stage
        workers) within one retry window, so a room takes as long as its slowest stage, not the sum
        of them: enforce holds a room for `timeout_ms` + `retry_s`, and stages asked one after
        another, each answering late, outlasted that (the room admitted unjudged)."""
        give_up = time.monotonic() + max(0.0, float(retry_s))
        until = give_up + self.timeout_ms / 1000.0  # a stage waiting for a worker gets what is left

        def ask(stage):
            if self._closed:
                return None
            return self.fetch(stage, key, retry_s=max(0.0, give_up - time.monotonic()), until=until)

        others = [self._submit_stage(ask, stage) for stage in stages[1:]]
        digests = [ask(stages[0])] if stages else []
        # each request ends by `until`, and one queued past it is not sent: the wait is bounded
        digests += [_answer(other) for other in others]
        if any(digest is None for digest in digests):
            return None
        return combine_stage_digests(key, digests, stages.layout)

    def _submit_stage(self, ask, stage) -> Future:
        """`ask(stage)` on a stage worker; asked on this thread once the client is closed."""
        with self._lock:
            if self._stage_workers is None and not self._closed:
                self._stage_workers = ThreadPoolExecutor(max_workers=STAGE_WORKERS,
                                                         thread_name_prefix="dsv4-idxk-stages")
            workers = None if self._closed else self._stage_workers
        if workers is not None:
            try:
                return workers.submit(ask, stage)
            except RuntimeError:  # shut down by a close in between
                pass
        done: Future = Future()
        done.set_result(ask(stage))
        return done

    def _strikes_of(self, endpoint: Endpoint | None) -> int:
        if endpoint is None:
            return 0
        with self._lock:
            return self._strikes.get(_peer(endpoint), 0)

    def backoff_left(self, endpoint: Endpoint | None) -> float:
        """Seconds until the peer is asked again (0: now)."""
        if endpoint is None:
            return 0.0
        with self._lock:
            until = self._down_until.get(_peer(endpoint), 0.0)
        return max(0.0, until - time.monotonic())

    def _fetch(self, endpoint: Endpoint | None, key: str,
               until: float | None = None) -> tuple[RoomDigest | None, str | None]:
        """(digest, None) on an answer, else (None, the failure counted). The peer's session is
        checked out of the table for the request, so the lock guards the tables only and a
        silent peer holds up the threads asking it, not those asking others."""
        if endpoint is None:
            return None, self._fail("no_endpoint")
        if self._secret_error is not None:
            return None, self._fail("auth")
        endpoint = _peer(endpoint)
        with self._lock:
            if self._down_until.get(endpoint, 0.0) > time.monotonic():
                down = True
            else:
                down, session = False, self._sessions.pop(endpoint, None)
        if down:
            return None, self._fail("peer_down")
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        cut_short = until is not None and until < deadline  # the room's time ends before the peer's
        if cut_short:
            deadline = until
        reused = session is not None
        try:
            try:
                if session is None:
                    session = self._connect(endpoint, deadline)
                answer = self._request(session, key, deadline)
            except (_Closed, ConnectionError):
                if not reused:
                    raise
                session.sock.close()  # the peer dropped an idle connection: once more, on a new one
                session = self._connect(endpoint, deadline)
                answer = self._request(session, key, deadline)
            self._check_in(endpoint, session)
            with self._lock:
                self._strikes.pop(endpoint, None)  # it answered: the next failure starts the backoff afresh
            return (answer, None) if answer is not None else (None, self._fail("not_found"))
        except BaseException as exc:
            if session is not None:
                session.sock.close()
            if cut_short and isinstance(exc, (_Deadline, socket.timeout)):
                return None, self._fail("late")  # the room's time, not the peer's: no backoff for it
            return None, self._failed(endpoint, exc)

    def _failed(self, endpoint: Endpoint, exc: BaseException) -> str:
        """The failure `exc` of a request to `endpoint` (its session closed), counted; what
        it makes of the peer's backoff. Anything else is raised again (`fetch` counts it)."""
        if isinstance(exc, _Busy):
            # Full (a flood, or more peers than it takes): not our secret's fault; ask again soon.
            log.debug("exchange peer %s:%d is busy", *endpoint)
            self._mark_down(endpoint)
            return self._fail("busy")
        if isinstance(exc, (_Deadline, _Closed, ConnectionError, socket.timeout)):
            # Refused, reset or silent: the peer did not answer in time.
            self._mark_down(endpoint)
            return self._fail("timeout")
        if isinstance(exc, _Refused):
            self._mark_down(endpoint, at_once=True)
            with self._lock:
                warn = endpoint not in self._warned_auth
                if warn:
                    _remember(self._warned_auth, endpoint, None)
            if warn:
                log.warning("dsv4-idxk-probe exchange peer %s:%d: %s", *endpoint, exc)
            return self._fail("auth")
        if isinstance(exc, ExchangeError):
            log.debug("exchange answer from %s: %s", endpoint, exc)
            return self._fail("protocol")
        if isinstance(exc, OSError):
            log.debug("exchange request to %s failed", endpoint, exc_info=exc)
            return self._fail("transport")
        raise exc

    def _mark_down(self, endpoint: Endpoint, at_once: bool = False) -> None:
        """Skip the peer for a while: `backoff_initial_s`, doubled with each failure in a
        row, at most `backoff_s` (at once for one that refused our credentials)."""
        with self._lock:
            strikes = self._strikes.get(endpoint, 0) + 1
            _remember(self._strikes, endpoint, strikes)
            delay = self.backoff_s if at_once else min(self.backoff_s, self.backoff_initial_s * 2.0 ** min(strikes - 1, 30))
            _remember(self._down_until, endpoint, time.monotonic() + delay)

    def _check_in(self, endpoint: Endpoint, session: _Session) -> None:
        """Put a session that answered back in the table, most recently used last (the least
        recently used goes first past MAX_PEERS); one another thread put there meanwhile, or
        any after `close`, is closed."""
        with self._lock:
            old = self._sessions.pop(endpoint, None)
            if old is not None:
                old.sock.close()
            if self._closed:
                session.sock.close()
                return
            while len(self._sessions) >= MAX_PEERS:
                self._drop(next(iter(self._sessions)))
            self._sessions[endpoint] = session

    def _request(self, session: _Session, key: str, deadline: float) -> RoomDigest | None:
        request_id = next(self._ids)
        _send_all(session.sock, session.mac.seal(encode_request(request_id, key)), deadline)
        (size,) = auth.HEADER.unpack(_recv_exact(session.sock, auth.HEADER.size, deadline))
        if size > self.max_response_bytes:
            raise ExchangeError(f"response of {size} bytes exceeds max_response_bytes={self.max_response_bytes}")
        payload = _recv_exact(session.sock, size, deadline)
        if not session.mac.open(payload, _recv_exact(session.sock, auth.TAG, deadline)):
            raise _Refused("a response frame failed its authentication tag")
        answer_id, digest = decode_response(payload)
        if answer_id != request_id:
            raise ExchangeError(f"answer to request {answer_id}, expected {request_id}")
        if digest is not None and digest.key != key:
            raise ExchangeError(f"answer for room {digest.key!r}, asked for {key!r}")
        return digest

    def _connect(self, endpoint: Endpoint, deadline: float) -> _Session:
        host, port = endpoint
        sock = socket.create_connection((host, port), timeout=_left(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, auth.SERVER_HELLO, deadline, busy=True)
            if hello[: len(auth.MAGIC)] != auth.MAGIC:
                raise _Refused("not a dsv4-idxk-probe exchange (wrong greeting)")
            nonce_s, nonce_c = hello[len(auth.MAGIC) :], auth.new_nonce()
            try:
                _send_all(sock, auth.client_proof(self.secret, nonce_s, nonce_c), deadline)
                send_error = None
            except ConnectionError as exc:  # closed meanwhile: what it said before (BUSY or nothing) tells why
                send_error = exc
            try:
                proof = _recv_exact(sock, auth.MAC, deadline, busy=True)
            except _Closed:
                if send_error is not None:
                    raise send_error from None  # reset while we spoke, nothing said: as before
                raise _Refused("the peer refused our credentials (is exchange.secret_file the same on both sides?)") from None
            if proof != auth.server_proof(self.secret, nonce_s, nonce_c):
                raise _Refused("the peer does not know our secret")
            return _Session(sock, auth.FrameMac(auth.session_key(self.secret, nonce_s, nonce_c), b"C", b"S"))
        except BaseException:
            sock.close()
            raise

    def _drop(self, endpoint: Endpoint) -> None:
        session = self._sessions.pop(endpoint, None)
        if session is not None:
            session.sock.close()

    def count_late(self) -> None:
        """A fetch an enforce hold gave up on, still running past the longest a fetch may take
        (exchange/prefetch.py): the room was admitted unjudged."""
        self._fail("late")

    def _fail(self, kind: str) -> str:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
        self._count(kind, 1)
        return kind

    def _count(self, kind: str, n: int) -> None:
        if self.metrics is not None:
            try:
                self.metrics.exchange_errors.labels(kind=kind).inc(n)
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for endpoint in list(self._sessions):
                self._drop(endpoint)
            workers, self._stage_workers = self._stage_workers, None
        if workers is not None:
            workers.shutdown(wait=False, cancel_futures=True)  # queued: never sent; running: end by `until`


def _answer(stage: Future) -> RoomDigest | None:
    """A stage request's digest; None for one a close cancelled before it was sent."""
    try:
        return stage.result()
    except CancelledError:
        return None


def _peer(endpoint: Endpoint) -> Endpoint:
    """The table key of a peer, however its address came (a list from JSON, a port as text)."""
    return str(endpoint[0]), int(endpoint[1])


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Deadline()
    return left


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        sock.settimeout(_left(deadline))
        try:
            n = sock.send(view)
        except socket.timeout:
            raise _Deadline() from None
        view = view[n:]


def _recv_exact(sock: socket.socket, n: int, deadline: float, busy: bool = False) -> bytes:
    """n bytes, read in bounded pieces (never more than asked). `busy`: a peer that closes after
    saying only `auth.BUSY` (a server turning us away before the handshake is done) raises _Busy."""
    parts, got = [], 0
    while got < n:
        sock.settimeout(_left(deadline))
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout:
            raise _Deadline() from None
        except ConnectionError:
            if busy and b"".join(parts) == auth.BUSY:
                raise _Busy() from None
            raise
        if not chunk:
            if busy and b"".join(parts) == auth.BUSY:
                raise _Busy()
            raise _Closed()
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def raw_request(endpoint: Endpoint, payload: bytes, *, secret: bytes = b"", timeout_s: float = 2.0) -> bytes | None:
    """Send one arbitrary payload over an authenticated session and return the answer's payload
    (None when the peer closed instead). For tests and benches that play a misbehaving peer."""
    deadline = time.monotonic() + timeout_s
    client = VectorClient(secret=secret)
    session = client._connect(_peer(endpoint), deadline)
    try:
        _send_all(session.sock, session.mac.seal(payload), deadline)
        (size,) = auth.HEADER.unpack(_recv_exact(session.sock, auth.HEADER.size, deadline))
        answer = _recv_exact(session.sock, size, deadline)
        _recv_exact(session.sock, auth.TAG, deadline)
        return answer
    except (_Closed, ConnectionError):
        return None
    finally:
        session.sock.close()


def _remember(table: dict, key: Any, value: Any) -> None:
    """`table[key] = value`, the oldest entry dropped first when a new key would pass `MAX_PEERS`."""
    if key not in table and len(table) >= MAX_PEERS:
        del table[next(iter(table))]
    table[key] = value
