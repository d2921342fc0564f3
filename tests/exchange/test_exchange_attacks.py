"""Issue 17's attacks on the exchange, each against a real server on loopback.

The nested-JSON frame, the unfinished multipart flood (a real zmq DEALER, as
in the report), a flood of idle connections into a 256-descriptor process,
unauthenticated peers, a malicious server, and a serving loop that fails.
Memory is measured on a server child, so the attackers' own buffers never count.

Round two (fair admission): an unauthenticated connect flood from one address
while fresh peers open sessions, one key holder holding every session, and a
client turned away for load that must say "busy", not "secret". Peers get
distinct loopback source addresses (127.0.0.2, ...) by binding their sockets.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from peers import ServerChild, ZmqAttacker

from dsv4_idxk_probe.digest.result import RoomDigest
from dsv4_idxk_probe.exchange import ExchangeError, VectorClient, VectorServer
from dsv4_idxk_probe.exchange import auth
from dsv4_idxk_probe.exchange.address import BindRefused, scope
from dsv4_idxk_probe.exchange.client import raw_request
from dsv4_idxk_probe.exchange.protocol import decode_request, decode_response, encode_request, encode_response
from dsv4_idxk_probe.exchange.server import SERVER_KINDS

SECRET = b"a shared secret of the cluster"
MIB = 1 << 20


def digest(key: str) -> RoomDigest:
    rng = np.random.default_rng(3)
    return RoomDigest(key=key, signature=7, n_tokens=128, layer_ids=(1, 3), segments=("payload", "scale"),
                      layer_segment=rng.integers(0, 2**63, (2, 2), dtype=np.uint64),
                      pages=rng.integers(0, 2**63, 2, dtype=np.uint64))


@pytest.fixture
def server():
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, max_request_bytes=4096)
    srv.start()
    yield srv
    srv.close()


def served(srv) -> bool:
    client = VectorClient(timeout_ms=2000, secret=SECRET)
    try:
        got = client.fetch(srv.endpoint, "7/0")
        return got is not None and got.key == "7/0"
    finally:
        client.close()


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# %% the nested-JSON frame: b"[" * 3000


def test_nested_json_frame_from_a_zmq_peer_is_refused_and_serving_goes_on(server):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        sock.send(b"[" * 3000, zmq.NOBLOCK)
        assert wait_for(lambda: server.counts.get("refused_auth", 0) >= 1)
    finally:
        sock.close(0)
    assert server.thread.is_alive() and served(server)


def test_nested_json_frame_from_an_authenticated_peer_is_a_refusal(server):
    answer = raw_request(server.endpoint, b"[" * 3000, secret=SECRET)
    with pytest.raises(ExchangeError, match="peer refused the request: request does not follow the schema"):
        decode_response(answer)
    assert server.counts == {"refused_request": 1}
    assert server.thread.is_alive() and served(server)


@pytest.mark.parametrize("frame", [b"[" * 3000, b"{" * 3000, b'{"v":1,"id":1,"key":' + b"[" * 100_000])
def test_request_decoder_refuses_deep_nesting_by_name(frame):
    with pytest.raises(ExchangeError, match="request does not follow the schema|request is not JSON"):
        decode_request(frame, 1 << 20)


# %% the unfinished multipart flood: 150,000 frames of 4,000 B with MORE set


def test_unfinished_multipart_flood_from_a_zmq_dealer_leaves_memory_flat():
    child = ServerChild(secret=SECRET.decode())
    attackers = []
    try:
        before = child.rss_bytes()
        attackers.append(ZmqAttacker(child.port, 150_000, 4_000))
        deadline = time.monotonic() + 20.0  # the attacker's libzmq keeps reconnecting and resending its greeting
        while True:
            time.sleep(0.5)
            stats = child.stats()
            refused = stats["counts"].get("refused_auth", 0) + stats["counts"].get("handshake_timeout", 0)
            if refused or time.monotonic() > deadline:  # on a busy machine the first refusal takes a while
                break
        during = child.rss_bytes()
        assert stats["alive"] and stats["counts"].get("refused_auth", 0) + stats["counts"].get("handshake_timeout", 0) >= 1
        assert during - before < 8 * MIB, (before, during)
        assert served_by_port(child.port)
    finally:
        for a in attackers:
            a.close()
        child.close()


def served_by_port(port: int) -> bool:
    client = VectorClient(timeout_ms=3000, secret=SECRET)
    try:
        got = client.fetch(("127.0.0.1", port), "7/0")
        return got is not None
    finally:
        client.close()


def test_a_request_longer_than_the_limit_is_refused_before_it_is_read(server):
    """Our framing's multipart: the length comes first; 4,000 B frames past the cap never get buffered."""
    sock = socket.create_connection(server.endpoint)
    try:
        hello = sock.recv(auth.SERVER_HELLO)
        nonce_c = auth.new_nonce()
        sock.sendall(auth.client_proof(SECRET, hello[4:], nonce_c))
        assert len(sock.recv(auth.MAC)) == auth.MAC
        sock.sendall(auth.HEADER.pack(600_000_000))  # 150,000 x 4,000 B announced
        try:
            for _ in range(1000):
                sock.sendall(b"x" * 4000)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert wait_for(lambda: server.counts.get("refused_too_big") == 1)
    finally:
        sock.close()
    assert served(server)


# %% connection flood: 244 idle connections against a 256-descriptor process


def test_idle_connection_flood_cannot_exhaust_descriptors():
    child = ServerChild(nofile=256, secret=SECRET.decode(), max_connections=64, handshake_s=30.0)
    flood = []
    try:
        for _ in range(244):
            flood.append(socket.create_connection(child.endpoint))
        time.sleep(0.5)
        stats = child.stats()
        assert stats["connections"] <= 64
        assert child.fds() < 100, child.fds()
        assert child.ask("open") == "ok"  # the process can still open files
        assert served_by_port(child.port)  # a real peer evicts an unauthenticated one
        counts = child.stats()["counts"]
        assert counts.get("evicted_unauthenticated", 0) >= 244 - 64
    finally:
        for s in flood:
            s.close()
        child.close()


def test_connections_that_never_authenticate_are_dropped_after_the_handshake_time():
    srv = VectorServer(dict().get, bind="127.0.0.1", secret=SECRET, handshake_s=0.3)
    srv.start()
    idle = [socket.create_connection(srv.endpoint) for _ in range(5)]
    try:
        assert wait_for(lambda: srv.counts.get("handshake_timeout") == 5, 3.0)
        assert srv.connections == 0
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_idle_authenticated_peer_is_dropped_and_the_client_reconnects():
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, idle_s=0.3)
    srv.start()
    client = VectorClient(timeout_ms=2000, secret=SECRET)
    try:
        assert client.fetch(srv.endpoint, "7/0") is not None
        assert wait_for(lambda: srv.counts.get("dropped_idle") == 1, 3.0)
        assert client.fetch(srv.endpoint, "7/0") is not None  # on a fresh connection, no failure counted
        assert client.failures == {}
    finally:
        client.close()
        srv.close()


def test_a_session_past_the_cap_closes_the_least_recently_used_one_whose_peer_reconnects():
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, max_connections=2)
    srv.start()
    clients = [VectorClient(timeout_ms=2000, secret=SECRET) for _ in range(3)]
    try:
        assert [c.fetch(srv.endpoint, "7/0") is not None for c in clients] == [True, True, True]
        assert srv.counts.get("evicted_authenticated") == 1 and srv.connections == 2
        assert clients[0].fetch(srv.endpoint, "7/0") is not None  # its session was closed: a fresh one
        assert [c.failures for c in clients] == [{}, {}, {}]
        assert srv.counts.get("evicted_authenticated") == 2 and srv.connections == 2
        assert "refused_connections" not in srv.counts
    finally:
        for c in clients:
            c.close()
        srv.close()


# %% authentication


def test_peer_with_a_wrong_secret_is_refused_both_ways(server):
    wrong = VectorClient(timeout_ms=1000, secret=b"not the secret, not at all")
    assert wrong.fetch(server.endpoint, "7/0") is None
    assert wrong.failures == {"auth": 1} and server.counts == {"refused_auth": 1}
    none = VectorClient(timeout_ms=1000)  # no secret at all
    assert none.fetch(server.endpoint, "7/0") is None and none.failures == {"auth": 1}
    wrong.close()
    none.close()
    assert served(server)


def test_client_refuses_a_server_that_does_not_know_the_secret():
    impostor = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=b"an impostor's own secret!!")
    impostor.start()
    client = VectorClient(timeout_ms=1000, secret=SECRET)
    try:
        assert client.fetch(impostor.endpoint, "7/0") is None and client.failures == {"auth": 1}
    finally:
        client.close()
        impostor.close()


def test_a_tampered_frame_is_refused_and_the_connection_closed(server):
    sock = socket.create_connection(server.endpoint)
    try:
        hello = sock.recv(auth.SERVER_HELLO)
        nonce_c = auth.new_nonce()
        sock.sendall(auth.client_proof(SECRET, hello[4:], nonce_c))
        sock.recv(auth.MAC)
        mac = auth.FrameMac(auth.session_key(SECRET, hello[4:], nonce_c), b"C", b"S")
        frame = bytearray(mac.seal(b'{"v":1,"id":1,"key":"7/0"}'))
        frame[10] ^= 1
        sock.sendall(bytes(frame))
        assert sock.recv(100) == b""
    finally:
        sock.close()
    assert server.counts == {"refused_mac": 1}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.internal"])
def test_wildcard_or_routable_bind_needs_a_secret(host):
    with pytest.raises(BindRefused, match="without peer authentication: set exchange.secret_file"):
        VectorServer(dict().get, bind=host).start()


def test_wildcard_bind_with_a_secret_is_allowed_and_warned_once(caplog):
    caplog.set_level(logging.WARNING, "dsv4_idxk_probe.exchange")
    servers = [VectorServer(dict().get, bind="0.0.0.0", secret=SECRET) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        warnings = [r for r in caplog.records if "listens on wildcard address 0.0.0.0" in r.getMessage()]
        assert len(warnings) <= 1  # once per process (an earlier test may have logged it)
    finally:
        for s in servers:
            s.close()


def test_address_scopes():
    assert [scope(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "10.0.0.5")] == [
        "loopback", "loopback", "loopback", "wildcard", "wildcard", "routable"]


def test_secret_file_must_be_a_regular_small_file(tmp_path):
    good = tmp_path / "secret"
    good.write_text("  0123456789abcdef0123\n")
    assert auth.load_secret(good) == b"0123456789abcdef0123"
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(auth.SecretError, match="at least 16 bytes"):
        auth.load_secret(short)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    with pytest.raises(auth.SecretError, match="over the 4,096-byte limit"):
        auth.load_secret(big)
    with pytest.raises(auth.SecretError, match="not a regular file"):
        auth.load_secret("/dev/zero")
    with pytest.raises(auth.SecretError, match="cannot read exchange secret"):
        auth.load_secret(tmp_path / "missing")


def test_server_and_client_read_the_same_secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret_file=str(path))
    srv.start()
    client = VectorClient(timeout_ms=2000, secret_file=str(path))
    try:
        assert client.fetch(srv.endpoint, "7/0") is not None
    finally:
        client.close()
        srv.close()


# %% a malicious server: VectorClient.fetch never raises


class EvilServer:
    """Speaks the handshake, then answers every request with `answer`."""

    def __init__(self, answer: bytes):
        import threading

        self.answer = answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.endpoint = self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            nonce_s = auth.new_nonce()
            conn.sendall(auth.server_hello(nonce_s))
            hello = conn.recv(auth.CLIENT_HELLO)
            nonce_c = hello[: auth.NONCE]
            conn.sendall(auth.server_proof(SECRET, nonce_s, nonce_c))
            conn.recv(1 << 16)
            mac = auth.FrameMac(auth.session_key(SECRET, nonce_s, nonce_c), b"S", b"C")
            conn.sendall(mac.seal(self.answer))
            time.sleep(0.5)

    def close(self):
        self.listener.close()


@pytest.mark.parametrize("answer", [
    b"[" * 3000,
    b'{"v":1,"id":1,"found":true,"digest":' + b"[" * 50_000 + b"}",
    b'{"v":1,"id":1,"found":true,"digest":{"key":"7/0","signature":"0000000000000007","n_tokens":1,'
    b'"layer_ids":[1],"segments":["payload"],"layer_segment":[["1ffffffffffffffff"]],"pages":[]}}',
    b'{"v":1,"id":1,"found":true,"digest":{"key":"7/0","signature":"0000000000000007","n_tokens":1e400,'
    b'"layer_ids":[1],"segments":["payload"],"layer_segment":[["0000000000000001"]],"pages":[]}}',
    b'{"v":1,"id":1,"found":true,"digest":{"key":"7/0","signature":"0000000000000007","n_tokens":1,'
    b'"layer_ids":[1,2],"segments":["payload"],"layer_segment":[["0000000000000001"]],"pages":[]}}',
    b'{"v":1,"id":99999999999999999999999,"found":false}',
    b"\xff\xfe",
])
def test_malicious_answers_are_a_protocol_failure_never_an_exception(answer):
    evil = EvilServer(answer)
    client = VectorClient(timeout_ms=2000, secret=SECRET)
    try:
        assert client.fetch(evil.endpoint, "7/0") is None
        assert client.failures == {"protocol": 1}
    finally:
        client.close()
        evil.close()


def test_an_answer_announcing_more_than_max_response_bytes_is_refused_unread():
    evil = EvilServer(b"x" * 2048)
    client = VectorClient(timeout_ms=2000, secret=SECRET, max_response_bytes=1024)
    try:
        assert client.fetch(evil.endpoint, "7/0") is None and client.failures == {"protocol": 1}
    finally:
        client.close()
        evil.close()


def test_encode_then_decode_response_keeps_values_past_63_bits():
    d = digest("7/0")
    d.layer_segment[0, 0] = np.uint64(2**64 - 1)
    _, got = decode_response(encode_response(1, d))
    assert int(got.layer_segment[0, 0]) == 2**64 - 1


# %% a serving loop that fails


def test_failed_serving_loop_is_restarted_counted_and_bounded(monkeypatch):
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, max_restarts=2)
    failures = {"left": 1}
    real_sweep = srv._sweep

    def sweep(now):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected")
        real_sweep(now)

    monkeypatch.setattr(srv, "_sweep", sweep)
    srv.start()
    try:
        assert wait_for(lambda: srv.restarts == 1)
        assert served(srv) and srv.counts.get("server_restart") == 1
        failures["left"] = 10
        assert wait_for(lambda: not srv.thread.is_alive(), 5.0)
        assert srv.stopped_by_failure and srv.restarts == 2 and srv.counts.get("server_stopped") == 1
    finally:
        srv.close()


# %% round two: fair admission


FLOODER = r"""
import select, socket, struct, sys, time
port, source, limit, held_max = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[5])
seconds = float(sys.argv[4])
reset = struct.pack("ii", 1, 0)  # close with a reset: no TIME_WAIT, the flood cannot run out of ports
held, made, failed, end = [], 0, 0, time.monotonic() + seconds
print("ready", flush=True)
while made < limit and failed < limit and time.monotonic() < end:
    if made % 64 == 0 and select.select([sys.stdin], [], [], 0)[0]:
        break
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
    s.settimeout(0.2)  # a dropped SYN costs a second: try the next one instead
    try:
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        failed += 1
        continue
    made += 1
    held.append(s)  # never says a word; the oldest are let go
    if len(held) > held_max:
        held.pop(0).close()
print(made, flush=True)
"""


class Flooder:
    """A child connecting to `port` from `source` as fast as it can, never authenticating:
    at most `limit` connections in `seconds`, `held` of them open at once."""

    def __init__(self, port: int, source: str, *, limit: int = 100_000, seconds: float = 90.0, held: int = 200):
        args = [sys.executable, "-c", FLOODER, str(port), source, str(limit), str(seconds), str(held)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> int:
        """The connections it made (-1: it had to be killed)."""
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            made = int(self.proc.stdout.readline() or -1)
            self.proc.wait(10)
            return made
        except Exception:
            self.proc.kill()
            self.proc.wait()
            return -1


class KeyHolder:
    """A peer holding the secret, played by hand from `source`: one authenticated session."""

    def __init__(self, endpoint, source: str):
        self.sock = socket.socket()
        self.sock.settimeout(5.0)
        self.ids = 0
        try:
            self.sock.bind((source, 0))
            self.sock.connect(endpoint)
            hello = self._recv(auth.SERVER_HELLO)
            nonce_c = auth.new_nonce()
            self.sock.sendall(auth.client_proof(SECRET, hello[4:], nonce_c))
            self._recv(auth.MAC)
            self.mac = auth.FrameMac(auth.session_key(SECRET, hello[4:], nonce_c), b"C", b"S")
        except BaseException:
            self.sock.close()
            raise

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError("closed by the server")
            data += chunk
        return data

    def ping(self) -> bool:
        """Ask for a room on this session: True when answered, False when the server closed it."""
        self.ids += 1
        try:
            self.sock.sendall(self.mac.seal(encode_request(self.ids, "7/0")))
            (size,) = auth.HEADER.unpack(self._recv(auth.HEADER.size))
            self._recv(size + auth.TAG)
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


def test_an_unauthenticated_connect_flood_from_one_address_does_not_keep_fresh_peers_out():
    """The report: a peer without the secret churning thousands of connects a second left 0 of
    25 fresh sessions served (each evicted before its handshake), reported as a secret mismatch."""
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET)  # the shipped bounds
    srv.start()
    flood = Flooder(srv.port, "127.0.0.2")
    outcomes = []
    try:
        # The flood is on: the server has had to turn its connections away.
        assert wait_for(lambda: srv.counts.get("evicted_unauthenticated", 0) >= 100, 30.0), srv.counts
        evicted_before = srv.counts["evicted_unauthenticated"]
        deadline = time.monotonic() + 120.0
        for _ in range(25):  # fresh sessions one after another, from 127.0.0.1, spread over the flood
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
            client = VectorClient(timeout_ms=5000, secret=SECRET)
            try:
                got = client.fetch(srv.endpoint, "7/0")
                outcomes.append((got is not None and got.key == "7/0", dict(client.failures)))
            finally:
                client.close()
        evicted_during = srv.counts["evicted_unauthenticated"] - evicted_before
    finally:
        made = flood.stop()
        srv.close()
    assert evicted_during >= 25, (evicted_during, made)  # the flood went on all along
    assert outcomes == [(True, {})] * 25, outcomes


def test_one_key_holder_holding_every_session_cannot_keep_a_new_peer_out():
    """The report: one key holder pinging 64 sessions starved every other peer."""
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET)  # 64 sessions
    srv.start()
    hog, others = [], []
    peer = VectorClient(timeout_ms=5000, secret=SECRET)
    try:
        hog.extend(KeyHolder(srv.endpoint, "127.0.0.2") for _ in range(64))
        assert all(h.ping() for h in hog) and srv.connections == 64
        got = peer.fetch(srv.endpoint, "7/0")  # a new peer, from 127.0.0.1
        assert got is not None and peer.failures == {}
        assert sum(h.ping() for h in hog) == 63  # one of the key holder's sessions made room
        # It keeps pinging and opens 64 sessions more: it only ever pushes out its own.
        for _ in range(64):
            hog.append(KeyHolder(srv.endpoint, "127.0.0.2"))
        assert sum(h.ping() for h in hog) == 63 and srv.connections == 64
        assert peer.fetch(srv.endpoint, "7/0") is not None and peer.failures == {}
        # Peers from further addresses are each admitted, and the first one still is.
        others.extend(KeyHolder(srv.endpoint, f"127.0.0.{n}") for n in (3, 4, 5))
        assert all(o.ping() for o in others)
        assert sum(h.ping() for h in hog) == 60 and srv.connections == 64
        assert peer.fetch(srv.endpoint, "7/0") is not None and peer.failures == {}
    finally:
        for h in hog + others:
            h.close()
        peer.close()
        srv.close()


def test_the_client_reports_busy_not_a_secret_mismatch_when_turned_away_for_load(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, "dsv4_idxk_probe.exchange")
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, max_pending=1)
    srv.start()
    client = VectorClient(timeout_ms=5000, secret=SECRET)
    turned_away = threading.Event()
    real_proof = auth.client_proof

    def held_proof(*args):  # the client answers the greeting only once the server has turned it away
        turned_away.wait(10.0)
        return real_proof(*args)

    monkeypatch.setattr(auth, "client_proof", held_proof)
    result = {}
    asking = threading.Thread(target=lambda: result.update(got=client.fetch(srv.endpoint, "7/0")), daemon=True)
    asking.start()
    other = None
    try:
        assert wait_for(lambda: srv.pending == 1, 10.0)  # greeted, answering
        other = socket.create_connection(srv.endpoint)  # one more from the same address: past its share
        assert wait_for(lambda: srv.counts.get("evicted_unauthenticated", 0) == 1, 10.0)
        turned_away.set()
        asking.join(15.0)
        assert not asking.is_alive() and result["got"] is None
        assert client.failures == {"busy": 1}
        assert not [r for r in caplog.records if "credentials" in r.getMessage() or "secret" in r.getMessage()]
        assert client.backoff_left(srv.endpoint) <= client.backoff_initial_s < client.backoff_s  # not 5 s
        monkeypatch.undo()
        other.close()
        got = client.fetch(srv.endpoint, "7/0", retry_s=5.0)  # asked again once the short backoff is over
        assert got is not None and client.failures["busy"] == 1 and set(client.failures) <= {"busy", "peer_down"}
    finally:
        turned_away.set()
        if other is not None:
            other.close()
        client.close()
        srv.close()


def test_the_new_kinds_have_their_series_created_at_start_and_every_count_is_one_of_them():
    class Series:  # exchange_errors_total{kind}, as the server uses it (one thread)
        def __init__(self):
            self.values, self.kind = {}, None

        def labels(self, kind):
            self.values.setdefault(kind, 0)
            self.kind = kind
            return self

        def inc(self, n=1):
            self.values[self.kind] += n

    class Metrics:
        exchange_errors = Series()

    metrics = Metrics()
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, metrics=metrics,
                       max_connections=1)
    srv.start()
    clients = [VectorClient(timeout_ms=2000, secret=SECRET) for _ in range(2)]
    try:
        assert set(SERVER_KINDS) >= {"evicted_unauthenticated", "evicted_authenticated", "refused_connections"}
        assert metrics.exchange_errors.values == dict.fromkeys(SERVER_KINDS, 0)
        assert all(c.fetch(srv.endpoint, "7/0") is not None for c in clients)
        assert metrics.exchange_errors.values["evicted_authenticated"] == 1
        assert set(srv.counts) <= set(SERVER_KINDS)
    finally:
        for c in clients:
            c.close()
        srv.close()
