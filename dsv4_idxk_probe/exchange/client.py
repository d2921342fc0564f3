"""Decode side: ask a prefill rank for a room's vectors, with a deadline.

One TCP connection per peer, authenticated once (`auth`) and reused. A
request not answered in `timeout_ms` closes that connection (so a late answer
is never mistaken for a later request's) and marks the peer down for
`backoff_s`: further requests to it return None at once. A peer that closed
an idle connection is asked again on a fresh one. Every failure is counted
in ``exchange_errors_total{kind}``; `fetch` never raises.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Any

from ..digest.result import RoomDigest
from . import auth
from .protocol import ExchangeError, decode_response, encode_request

log = logging.getLogger("dsv4_idxk_probe.exchange")

Endpoint = tuple[str, int]


class _Deadline(Exception):
    """The request's time is up."""


class _Refused(Exception):
    """The peer failed authentication or broke the framing."""


class _Closed(Exception):
    """The peer closed the connection."""


class _Session:
    def __init__(self, sock: socket.socket, mac: auth.FrameMac):
        self.sock = sock
        self.mac = mac
        self.used = False


class VectorClient:
    def __init__(
        self,
        *,
        timeout_ms: int = 200,
        backoff_s: float = 5.0,
        metrics: Any = None,
        max_response_bytes: int = 16 << 20,
        secret: bytes | None = None,
        secret_file: str | None = None,
    ):
        self.timeout_ms = int(timeout_ms)
        self.backoff_s = float(backoff_s)
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
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._warned_auth: set[Endpoint] = set()
        self._reused = False
        self.failures: dict[str, int] = {}

    def fetch(self, endpoint: Endpoint | None, key: str) -> RoomDigest | None:
        """The peer's digest of room `key`, or None (unknown peer or room, timeout, bad answer)."""
        try:
            return self._fetch(endpoint, key)
        except Exception:  # the docstring's promise: a bug here costs one room's localisation
            log.debug("exchange fetch of %s failed", key, exc_info=True)
            self._fail("internal")
            return None

    def _fetch(self, endpoint: Endpoint | None, key: str) -> RoomDigest | None:
        if endpoint is None:
            self._fail("no_endpoint")
            return None
        if self._secret_error is not None:
            self._fail("auth")
            return None
        endpoint = (str(endpoint[0]), int(endpoint[1]))
        with self._lock:
            if self._down_until.get(endpoint, 0.0) > time.monotonic():
                self._fail("peer_down")
                return None
            deadline = time.monotonic() + self.timeout_ms / 1000.0
            try:
                try:
                    return self._request(endpoint, key, deadline)
                except (_Closed, ConnectionError):
                    if not self._reused:
                        raise
                    self._drop(endpoint)  # the peer dropped an idle connection: once more, on a new one
                    return self._request(endpoint, key, deadline)
            except (_Deadline, _Closed, ConnectionError, socket.timeout):
                # Refused, reset or silent: the peer did not answer in time.
                self._drop(endpoint)
                self._down_until[endpoint] = time.monotonic() + self.backoff_s
                self._fail("timeout")
            except _Refused as exc:
                self._drop(endpoint)
                self._down_until[endpoint] = time.monotonic() + self.backoff_s
                if endpoint not in self._warned_auth:
                    self._warned_auth.add(endpoint)
                    log.warning("dsv4-idxk-probe exchange peer %s:%d: %s", *endpoint, exc)
                self._fail("auth")
            except ExchangeError as exc:
                log.debug("exchange answer from %s: %s", endpoint, exc)
                self._drop(endpoint)
                self._fail("protocol")
            except OSError:
                log.debug("exchange request to %s failed", endpoint, exc_info=True)
                self._drop(endpoint)
                self._fail("transport")
            return None

    def _request(self, endpoint: Endpoint, key: str, deadline: float) -> RoomDigest | None:
        session = self._sessions.get(endpoint)
        self._reused = session is not None and session.used
        if session is None:
            session = self._sessions[endpoint] = self._connect(endpoint, deadline)
        session.used = True
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
        if digest is None:
            self._fail("not_found")
        elif digest.key != key:
            raise ExchangeError(f"answer for room {digest.key!r}, asked for {key!r}")
        return digest

    def _connect(self, endpoint: Endpoint, deadline: float) -> _Session:
        host, port = endpoint
        sock = socket.create_connection((host, port), timeout=_left(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, auth.SERVER_HELLO, deadline)
            if hello[: len(auth.MAGIC)] != auth.MAGIC:
                raise _Refused("not a dsv4-idxk-probe exchange (wrong greeting)")
            nonce_s, nonce_c = hello[len(auth.MAGIC) :], auth.new_nonce()
            _send_all(sock, auth.client_proof(self.secret, nonce_s, nonce_c), deadline)
            try:
                proof = _recv_exact(sock, auth.MAC, deadline)
            except _Closed:
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

    def _fail(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if self.metrics is not None:
            try:
                self.metrics.exchange_errors.labels(kind=kind).inc()
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            for endpoint in list(self._sessions):
                self._drop(endpoint)


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


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """n bytes, read in bounded pieces (never more than asked)."""
    parts, got = [], 0
    while got < n:
        sock.settimeout(_left(deadline))
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout:
            raise _Deadline() from None
        if not chunk:
            raise _Closed()
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def raw_request(endpoint: Endpoint, payload: bytes, *, secret: bytes = b"", timeout_s: float = 2.0) -> bytes | None:
    """Send one arbitrary payload over an authenticated session and return the answer's payload
    (None when the peer closed instead). For tests and benches that play a misbehaving peer."""
    deadline = time.monotonic() + timeout_s
    client = VectorClient(secret=secret)
    session = client._connect((str(endpoint[0]), int(endpoint[1])), deadline)
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
