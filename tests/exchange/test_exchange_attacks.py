"""Issue 17's attacks on the exchange, each against a real server on loopback.

The nested-JSON frame, the unfinished multipart flood (a real zmq DEALER, as
in the report), a flood of idle connections into a 256-descriptor process,
unauthenticated peers, a malicious server, and a serving loop that fails.
Memory is measured on a server child, so the attackers' own buffers never count.
"""

from __future__ import annotations

import logging
import socket
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
from dsv4_idxk_probe.exchange.protocol import decode_request, decode_response, encode_response

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


def test_connections_past_the_cap_are_closed_at_once_when_every_slot_is_authenticated():
    srv = VectorServer({"7/0": digest("7/0")}.get, bind="127.0.0.1", secret=SECRET, max_connections=2)
    srv.start()
    clients = [VectorClient(timeout_ms=2000, secret=SECRET) for _ in range(3)]
    try:
        assert [c.fetch(srv.endpoint, "7/0") is not None for c in clients] == [True, True, False]
        assert srv.counts.get("refused_connections") == 1 and srv.connections == 2
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
