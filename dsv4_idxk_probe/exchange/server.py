"""Prefill side: answer "vectors for room R" from the table of recent rooms."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import zmq

from .protocol import ExchangeError, decode_request, encode_response

log = logging.getLogger("dsv4_idxk_probe.exchange")

Lookup = Callable[[str], Any]  # room key -> RoomDigest or None


class VectorServer:
    """A ROUTER socket on `bind`:`port` (port 0: one the OS picks), served by a
    daemon thread. Requests over `max_request_bytes` are refused by ZMQ
    itself (the connection is dropped) or answered with an error."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        bind: str,
        port: int = 0,
        max_request_bytes: int = 4096,
        metrics: Any = None,
        poll_ms: int = 100,
    ):
        if not bind:
            raise ValueError("VectorServer needs an address to bind (exchange.bind)")
        self.lookup = lookup
        self.bind = bind
        self.port = int(port)
        self.max_request_bytes = int(max_request_bytes)
        self.metrics = metrics
        self.poll_ms = poll_ms
        self.served = 0
        self.refused = 0
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self.thread: threading.Thread | None = None

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.bind, self.port

    def start(self) -> threading.Thread:
        """Bind (errors raise here, in the caller) and start serving."""
        if self.thread is not None:
            return self.thread
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes)
        address = f"tcp://{self.bind}" if ":" not in self.bind else f"tcp://[{self.bind}]"
        try:
            if self.port:
                sock.bind(f"{address}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(address)
        except zmq.ZMQError:
            sock.close()
            raise
        self._socket = sock
        self.thread = threading.Thread(target=self._serve, name="dsv4-idxk-exchange", daemon=True)
        self.thread.start()
        log.info("dsv4-idxk-probe exchange serving on %s:%d", self.bind, self.port)
        return self.thread

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout)
        self.thread = None

    def _serve(self) -> None:
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(self.poll_ms)):
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                if len(frames) != 2:
                    self._refuse("frames")
                    continue
                sock.send_multipart([frames[0], self._answer(frames[1])])
        except Exception:  # a serving thread must end quietly, never take the process down
            log.exception("dsv4-idxk-probe exchange server stopped")
        finally:
            sock.close(0)

    def _answer(self, payload: bytes) -> bytes:
        try:
            request_id, key = decode_request(payload, self.max_request_bytes)
        except ExchangeError as exc:
            self._refuse("request")
            return encode_response(-1, error=str(exc))
        try:
            digest = self.lookup(key)
        except Exception:
            log.debug("lookup of %s failed", key, exc_info=True)
            digest = None
        self.served += 1
        return encode_response(request_id, digest)

    def _refuse(self, kind: str) -> None:
        self.refused += 1
        if self.metrics is not None:
            try:
                self.metrics.exchange_errors.labels(kind=f"refused_{kind}").inc()
            except Exception:
                pass
