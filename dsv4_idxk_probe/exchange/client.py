"""Decode side: ask a prefill rank for a room's vectors, with a deadline.

One DEALER socket per peer. A request that is not answered in `timeout_ms`
closes that socket (so a late answer is never mistaken for a later request's)
and marks the peer down for `backoff_s`: further requests to it return None
at once. Every failure is counted in ``exchange_errors_total{kind}``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import zmq

from ..digest.result import RoomDigest
from .protocol import ExchangeError, decode_response, encode_request

log = logging.getLogger("dsv4_idxk_probe.exchange")

Endpoint = tuple[str, int]


class VectorClient:
    def __init__(
        self,
        *,
        timeout_ms: int = 200,
        backoff_s: float = 5.0,
        metrics: Any = None,
        max_response_bytes: int = 16 << 20,
    ):
        self.timeout_ms = int(timeout_ms)
        self.backoff_s = float(backoff_s)
        self.metrics = metrics
        self.max_response_bytes = int(max_response_bytes)
        self._ctx = zmq.Context.instance()
        self._sockets: dict[Endpoint, zmq.Socket] = {}
        self._down_until: dict[Endpoint, float] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.failures: dict[str, int] = {}

    def fetch(self, endpoint: Endpoint | None, key: str) -> RoomDigest | None:
        """The peer's digest of room `key`, or None (unknown peer or room, timeout, bad answer)."""
        if endpoint is None:
            self._fail("no_endpoint")
            return None
        endpoint = (str(endpoint[0]), int(endpoint[1]))
        with self._lock:
            if self._down_until.get(endpoint, 0.0) > time.monotonic():
                self._fail("peer_down")
                return None
            try:
                return self._request(endpoint, key)
            except zmq.ZMQError:
                log.debug("exchange request to %s failed", endpoint, exc_info=True)
                self._drop(endpoint)
                self._fail("transport")
                return None

    def _request(self, endpoint: Endpoint, key: str) -> RoomDigest | None:
        sock = self._socket(endpoint)
        request_id = next(self._ids)
        sock.send(encode_request(request_id, key), zmq.NOBLOCK)
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                self._drop(endpoint)
                self._down_until[endpoint] = time.monotonic() + self.backoff_s
                self._fail("timeout")
                return None
            frame = sock.recv(zmq.NOBLOCK)
            try:
                answer_id, digest = decode_response(frame)
            except ExchangeError as exc:
                log.debug("exchange answer from %s: %s", endpoint, exc)
                self._fail("protocol")
                return None
            if answer_id != request_id:
                continue  # an answer to an earlier request on this socket
            if digest is None:
                self._fail("not_found")
            elif digest.key != key:
                self._fail("protocol")
                return None
            return digest

    def _socket(self, endpoint: Endpoint) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_response_bytes)
            host, port = endpoint
            sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
            self._sockets[endpoint] = sock
        return sock

    def _drop(self, endpoint: Endpoint) -> None:
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def _fail(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if self.metrics is not None:
            try:
                self.metrics.exchange_errors.labels(kind=kind).inc()
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            for endpoint in list(self._sockets):
                self._drop(endpoint)
