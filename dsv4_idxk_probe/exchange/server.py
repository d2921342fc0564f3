"""Prefill side: answer "vectors for room R" from the table of recent rooms.

One daemon thread serves a TCP listener with a selector. What a peer can make
the server hold is bounded before it is read, and shared fairly between
source addresses (docs/security.md):

* unauthenticated connections: at most `max_pending`, of which at most
  `max_pending_per_address` from one source address. A new connection past
  either cap turns away the oldest unauthenticated connection of its own
  address, or else of the address holding the most, with the `auth.BUSY`
  notice (``evicted_unauthenticated``): a flood from one address churns only
  its own connections, never another peer's handshake;
* an unauthenticated peer: `auth.CLIENT_HELLO` bytes and `handshake_s`
  seconds, then it is authenticated or closed;
* authenticated sessions: at most `max_connections`. A session past the cap
  closes the least recently used session of the address holding the most
  sessions (its own on a tie; ``evicted_authenticated``), so one key holder
  cannot keep another peer out, and the new peer is always admitted (the
  evicted one reconnects when it next asks);
* a request: its length comes first and one over `max_request_bytes` closes
  the connection before a byte of it is buffered; one request at a time per
  connection (the next is not read until the answer is sent);
* an idle or stalled peer is closed after `idle_s`.

Every failure inside a request is a refusal, counted in
``exchange_errors_total{kind="refused_*"}``; the connection may be closed,
the thread goes on. Should the loop itself fail, it is restarted (at most
`max_restarts` times, counted as ``server_restart``; then
``server_stopped``).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Any, Callable

from . import auth
from .address import check_bind
from .protocol import ExchangeError, decode_request, encode_response

log = logging.getLogger("dsv4_idxk_probe.exchange")

Lookup = Callable[[str], Any]  # room key -> RoomDigest or None

ACCEPT_BURST = 32
# Series created at zero when a server starts. `refused_connections` is no longer counted (a new
# peer is always admitted now, docs/security.md); it stays so that existing alerts find it.
SERVER_KINDS = (
    "refused_auth", "refused_too_big", "refused_request", "refused_mac", "refused_connections",
    "refused_internal", "evicted_unauthenticated", "evicted_authenticated", "handshake_timeout",
    "dropped_idle", "accept", "server_restart", "server_stopped",
)


class _Conn:
    __slots__ = ("sock", "fd", "addr", "authed", "nonce", "buf", "need", "frame_len", "out", "mac", "last", "born")

    def __init__(self, sock: socket.socket, addr: str, nonce: bytes, now: float):
        self.sock = sock
        self.fd = sock.fileno()
        self.addr = addr  # the source address: what the per-address shares count
        self.authed = False
        self.nonce = nonce
        self.buf = bytearray()
        self.need = auth.CLIENT_HELLO  # bytes the current step still needs
        self.frame_len = -1  # -1: reading a header
        self.out = b""
        self.mac: auth.FrameMac | None = None
        self.last = self.born = now

    @property
    def idle(self) -> bool:
        """No request half read and no answer unsent."""
        return self.frame_len < 0 and not self.buf and not self.out


class VectorServer:
    """A TCP listener on `bind`:`port` (port 0: one the OS picks), served by a daemon thread."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        bind: str,
        port: int = 0,
        max_request_bytes: int = 4096,
        metrics: Any = None,
        poll_ms: int = 100,
        secret: bytes | None = None,
        secret_file: str | None = None,
        max_connections: int = 64,
        max_pending: int = 16,
        max_pending_per_address: int | None = None,
        handshake_s: float = 2.0,
        idle_s: float = 60.0,
        max_restarts: int = 5,
    ):
        if not bind:
            raise ValueError("VectorServer needs an address to bind (exchange.bind)")
        self.lookup = lookup
        self.bind = bind
        self.port = int(port)
        self.max_request_bytes = int(max_request_bytes)
        self.metrics = metrics
        self.poll_ms = poll_ms
        self.secret = secret
        self.secret_file = secret_file
        self.max_connections = max(1, int(max_connections))
        self.max_pending = max(1, min(int(max_pending), self.max_connections))
        per_address = self.max_pending // 2 if max_pending_per_address is None else int(max_pending_per_address)
        self.max_pending_per_address = max(1, min(per_address, self.max_pending))
        self.handshake_s = float(handshake_s)
        self.idle_s = float(idle_s)
        self.max_restarts = int(max_restarts)
        self.served = 0
        self.refused = 0
        self.restarts = 0
        self.stopped_by_failure = False
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._conns: dict[int, _Conn] = {}
        # source address -> its connections by descriptor, oldest first (insertion order)
        self._pending_of: dict[str, dict[int, _Conn]] = {}
        self._authed_of: dict[str, dict[int, _Conn]] = {}
        self._n_pending = 0
        self._accept_paused_until = 0.0
        self.thread: threading.Thread | None = None
        if metrics is not None:
            for kind in SERVER_KINDS:
                self._metric(kind, 0)

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.bind, self.port

    @property
    def connections(self) -> int:
        """Authenticated sessions and unauthenticated connections, together."""
        return len(self._conns)

    @property
    def pending(self) -> int:
        return self._n_pending

    @property
    def sessions(self) -> int:
        return len(self._conns) - self._n_pending

    def start(self) -> threading.Thread:
        """Check the address, load the secret, bind (errors raise here, in the caller) and start serving."""
        if self.thread is not None:
            return self.thread
        if self.secret is None and self.secret_file:
            self.secret = auth.load_secret(self.secret_file)
        check_bind(self.bind, authenticated=bool(self.secret))
        host = self.bind.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, self.port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.thread = threading.Thread(target=self._serve, name="dsv4-idxk-exchange", daemon=True)
        self.thread.start()
        log.info("dsv4-idxk-probe exchange serving on %s:%d (%s)", self.bind, self.port,
                 "peers authenticate" if self.secret else "no secret: loopback only")
        return self.thread

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout)
        self.thread = None

    # %% the serving thread

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._loop()
                    return
                except Exception:
                    self._close_all()
                    if self.restarts >= self.max_restarts:
                        self.stopped_by_failure = True
                        self._count("server_stopped")
                        log.exception("dsv4-idxk-probe exchange stopped after %d restarts", self.restarts)
                        return
                    self.restarts += 1
                    self._count("server_restart")
                    log.exception("dsv4-idxk-probe exchange loop failed; restart %d of %d",
                                  self.restarts, self.max_restarts)
                    self._stop.wait(min(5.0, 0.05 * 2**self.restarts))
        finally:
            self._close_all()
            if self._listener is not None:
                self._listener.close()

    def _loop(self) -> None:
        selector = self._selector = selectors.DefaultSelector()
        try:
            selector.register(self._listener, selectors.EVENT_READ, None)
            listening = True
            while not self._stop.is_set():
                now = time.monotonic()
                if not listening and now >= self._accept_paused_until:
                    selector.register(self._listener, selectors.EVENT_READ, None)
                    listening = True
                for key, events in selector.select(self.poll_ms / 1000.0):
                    if key.data is None:
                        if not self._accept():
                            selector.unregister(self._listener)
                            listening = False
                    else:
                        self._service(key.data, events)
                self._sweep(time.monotonic())
        finally:
            selector.close()
            self._selector = None

    def _accept(self) -> bool:
        """Take new connections; False when accepting must pause (out of descriptors)."""
        for _ in range(ACCEPT_BURST):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:  # EMFILE/ENFILE: leave them in the backlog for a while
                self._count("accept")
                log.debug("exchange accept failed: %s", exc)
                self._accept_paused_until = time.monotonic() + 0.1
                return False
            source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            mine = self._pending_of.get(source)
            if mine is not None and len(mine) >= self.max_pending_per_address:
                self._turn_away(next(iter(mine.values())))  # its own oldest: a flood churns only itself
            elif self._n_pending >= self.max_pending:
                self._turn_away(self._pending_victim())
            self._open(sock, source)
        return True

    def _pending_victim(self) -> _Conn:
        """The oldest unauthenticated connection of the address holding the most (the oldest on a tie)."""
        held = max(self._pending_of.values(), key=lambda conns: (len(conns), -next(iter(conns.values())).born))
        return next(iter(held.values()))

    def _turn_away(self, conn: _Conn) -> None:
        """Take an unauthenticated connection out of the pending ones to make room: a hello that
        has already arrived is checked first (a burst of honest peers is not turned away unread);
        otherwise the connection is closed for load, telling the peer so (`auth.BUSY`)."""
        try:
            self._read(conn)
        except (BlockingIOError, InterruptedError):
            pass
        except Exception:
            self._close(conn)
            return
        if self._conns.get(conn.fd) is not conn or conn.authed:
            return
        try:
            # Read the rest of what it sent (at most its hello): closing on unread bytes would
            # reset the connection, and the peer could lose the notice.
            conn.sock.recv(auth.CLIENT_HELLO)
        except OSError:
            pass
        try:
            conn.sock.send(auth.BUSY)
        except OSError:
            pass
        self._close(conn, "evicted_unauthenticated")

    def _open(self, sock: socket.socket, source: str) -> None:
        sock.setblocking(False)
        conn = _Conn(sock, source, auth.new_nonce(), time.monotonic())
        try:
            sock.send(auth.server_hello(conn.nonce))  # 20 bytes into an empty socket buffer
        except OSError:
            sock.close()
            return
        self._conns[conn.fd] = conn
        self._pending_of.setdefault(source, {})[conn.fd] = conn
        self._n_pending += 1
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _service(self, conn: _Conn, events: int) -> None:
        if self._conns.get(conn.fd) is not conn:
            return  # closed earlier in this round (evicted), its descriptor maybe reused
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            elif events & selectors.EVENT_READ:
                self._read(conn)
        except (ConnectionError, OSError):
            self._close(conn)
        except Exception:
            log.debug("exchange request failed", exc_info=True)
            self._refuse("internal")
            self._close(conn)

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(conn.need - len(conn.buf))
        if not data:
            self._close(conn)
            return
        conn.buf += data
        if len(conn.buf) < conn.need:
            return
        chunk, conn.buf = bytes(conn.buf), bytearray()
        conn.last = time.monotonic()
        if not conn.authed:
            self._handshake(conn, chunk)
        elif conn.frame_len < 0:
            (size,) = auth.HEADER.unpack(chunk)
            if size > self.max_request_bytes:
                self._refuse("too_big")
                self._close(conn)
                return
            conn.frame_len, conn.need = size, size + auth.TAG
        else:
            payload, tag = chunk[: conn.frame_len], chunk[conn.frame_len :]
            conn.frame_len, conn.need = -1, auth.HEADER.size
            if not conn.mac.open(payload, tag):
                self._refuse("mac")
                self._close(conn)
                return
            self._send(conn, conn.mac.seal(self._answer(payload)))

    def _handshake(self, conn: _Conn, hello: bytes) -> None:
        secret = self.secret or b""
        nonce_c = auth.check_client(secret, conn.nonce, hello)
        if nonce_c is None:
            self._refuse("auth")
            self._close(conn)
            return
        self._authenticated(conn)
        conn.mac = auth.FrameMac(auth.session_key(secret, conn.nonce, nonce_c), b"S", b"C")
        conn.need = auth.HEADER.size
        self._send(conn, auth.server_proof(secret, conn.nonce, nonce_c))

    def _authenticated(self, conn: _Conn) -> None:
        """Move `conn` to the sessions; past `max_connections`, close another one to make room."""
        self._forget(conn)
        conn.authed = True
        self._authed_of.setdefault(conn.addr, {})[conn.fd] = conn
        if len(self._conns) - self._n_pending > self.max_connections:
            victim = self._session_victim(conn)
            if victim is not None:
                self._close(victim, "evicted_authenticated")

    def _session_victim(self, newcomer: _Conn) -> _Conn | None:
        """The least recently used session (idle ones first) of the address holding the most
        sessions, the newcomer counted; its own address on a tie; never the newcomer."""
        best_rank, victim = None, None
        for address, conns in self._authed_of.items():
            candidate = min((c for c in conns.values() if c is not newcomer),
                            key=lambda c: (not c.idle, c.last), default=None)
            if candidate is None:
                continue
            rank = (len(conns), address == newcomer.addr, candidate.idle, -candidate.last)
            if best_rank is None or rank > best_rank:
                best_rank, victim = rank, candidate
        return victim

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
        try:
            answer = encode_response(request_id, digest)
        except Exception as exc:
            self._refuse("internal")
            return encode_response(request_id, error=f"cannot encode the digest: {exc.__class__.__name__}")
        self.served += 1
        return answer

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.out = data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        sent = conn.sock.send(conn.out) if conn.out else 0
        conn.out = conn.out[sent:]
        if sent:
            conn.last = time.monotonic()
        # While an answer is unsent, nothing more is read from this peer.
        self._selector.modify(conn.sock, selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ, conn)

    def _sweep(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if not conn.authed and now - conn.born > self.handshake_s:
                self._close(conn, "handshake_timeout")
            elif conn.authed and now - conn.last > self.idle_s:
                self._close(conn, "dropped_idle")

    def _close(self, conn: _Conn, kind: str | None = None) -> None:
        if kind is not None:
            self._count(kind)
        self._forget(conn)
        if self._conns.get(conn.fd) is conn:  # not yet closed (its descriptor may be another's now)
            del self._conns[conn.fd]
            if self._selector is not None:
                try:
                    self._selector.unregister(conn.sock)
                except (KeyError, ValueError):
                    pass
        conn.sock.close()

    def _forget(self, conn: _Conn) -> None:
        """Take `conn` out of its address's share (pending or sessions)."""
        table = self._authed_of if conn.authed else self._pending_of
        conns = table.get(conn.addr)
        if conns is None or conns.get(conn.fd) is not conn:
            return
        del conns[conn.fd]
        if not conn.authed:
            self._n_pending -= 1
        if not conns:
            del table[conn.addr]

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            try:
                self._close(conn)
            except Exception:
                pass
        self._conns.clear()
        self._pending_of.clear()
        self._authed_of.clear()
        self._n_pending = 0

    def _refuse(self, kind: str) -> None:
        self.refused += 1
        self._count(f"refused_{kind}")

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self._metric(kind, 1)

    def _metric(self, kind: str, n: int) -> None:
        if self.metrics is not None:
            try:
                self.metrics.exchange_errors.labels(kind=kind).inc(n)
            except Exception:
                pass

