"""The prefill->decode vector exchange over real sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from dsv4_idxk_probe.digest.result import RoomDigest
from dsv4_idxk_probe.exchange import ExchangeError, VectorClient, VectorServer, pack_endpoint, unpack_endpoint
from dsv4_idxk_probe.exchange.client import raw_request
from dsv4_idxk_probe.exchange.protocol import decode_request, decode_response, encode_request, encode_response


def digest(key: str, seed: int = 0) -> RoomDigest:
    rng = np.random.default_rng(seed)
    return RoomDigest(
        key=key, signature=0xABCDEF0123456789, n_tokens=612, layer_ids=(1, 3, 5), segments=("payload", "scale"),
        layer_segment=rng.integers(0, 2**63, (3, 2), dtype=np.uint64) * np.uint64(2),
        pages=rng.integers(0, 2**63, 3, dtype=np.uint64),
    )


@pytest.fixture
def table():
    return {"7/0": digest("7/0", 1), "8/0": digest("8/0", 2)}


@pytest.fixture
def server(table):
    srv = VectorServer(table.get, bind="127.0.0.1", port=0, max_request_bytes=256)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def client():
    c = VectorClient(timeout_ms=300, backoff_s=0.5)
    yield c
    c.close()


def test_round_trip(server, client, table):
    got = client.fetch(server.endpoint, "7/0")
    want = table["7/0"]
    assert (got.key, got.signature, got.n_tokens, got.layer_ids) == (want.key, want.signature, want.n_tokens, want.layer_ids)
    assert np.array_equal(got.layer_segment, want.layer_segment) and np.array_equal(got.pages, want.pages)
    assert server.served == 1


def test_unknown_room_is_none_and_counted(server, client):
    assert client.fetch(server.endpoint, "9/0") is None
    assert client.failures == {"not_found": 1}
    assert client.fetch(server.endpoint, "8/0").key == "8/0"  # the connection still works


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_peer_fails_once_then_is_skipped_until_backoff(client):
    dead = ("127.0.0.1", _free_port())
    assert client.fetch(dead, "7/0") is None  # connection refused: no answer, at once
    started = time.monotonic()
    assert client.fetch(dead, "7/0") is None
    second = time.monotonic() - started
    assert client.failures == {"timeout": 1, "peer_down": 1}
    assert second < 0.05


def test_a_client_keeps_state_for_a_bounded_number_of_peers(monkeypatch, table):
    """Prefill endpoints change with every restart: the backoffs of dead ones and the
    sessions of old ones are kept for the `MAX_PEERS` most recent, the oldest dropped (a
    session's socket closed), so a long-lived decode holds no entry per endpoint ever seen."""
    from dsv4_idxk_probe.exchange import client as client_module

    monkeypatch.setattr(client_module, "MAX_PEERS", 3)
    servers = [VectorServer(table.get, bind="127.0.0.1", port=0) for _ in range(5)]
    for srv in servers:
        srv.start()
    c = VectorClient(timeout_ms=300, backoff_s=0.5)
    try:
        for _ in range(5):
            assert c.fetch(("127.0.0.1", _free_port()), "7/0") is None  # a dead peer each
        assert len(c._down_until) == len(c._strikes) == 3
        for srv in servers:
            assert c.fetch(srv.endpoint, "7/0").key == "7/0"
        assert list(c._sessions) == [srv.endpoint for srv in servers[2:]]
        assert c.fetch(servers[0].endpoint, "8/0").key == "8/0"  # asked again: a new session, the oldest goes
        assert list(c._sessions) == [srv.endpoint for srv in servers[3:]] + [servers[0].endpoint]
    finally:
        c.close()
        for srv in servers:
            srv.close()


def test_a_fetch_from_stages_never_raises(monkeypatch, server):
    """Whatever goes wrong combining the stages' digests costs the room's verdict, counted,
    never an exception out of `fetch` (its callers judge rooms on the collector)."""
    from dsv4_idxk_probe.digest import get_layout
    from dsv4_idxk_probe.exchange import client as client_module
    from dsv4_idxk_probe.exchange.stages import StageEndpoints

    def broken(*_a, **_k):
        raise ValueError("a stage's rows do not stack")

    monkeypatch.setattr(client_module, "combine_stage_digests", broken)
    c = VectorClient(timeout_ms=300)
    try:
        assert c.fetch(StageEndpoints([server.endpoint], get_layout("fp8")), "7/0") is None
        assert c.failures == {"internal": 1}
    finally:
        c.close()


def test_silent_peer_times_out_within_the_deadline(client):
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        started = time.monotonic()
        assert client.fetch(silent.getsockname(), "7/0") is None
        took = time.monotonic() - started
    assert client.failures == {"timeout": 1}
    assert 0.25 < took < 2.0


def _slow_server(table: dict, delay_s: float) -> tuple[VectorServer, dict]:
    """A started server whose lookups take `delay_s` while `slow["on"]` (a busy prefill rank)."""
    slow = {"on": True}

    def lookup(key):
        if slow["on"]:
            time.sleep(delay_s)
        return table.get(key)

    srv = VectorServer(lookup, bind="127.0.0.1", max_request_bytes=256)
    srv.start()
    return srv, slow


def test_slow_peer_then_recovers_with_a_new_connection(client, table):
    srv, slow = _slow_server(table, 0.6)
    try:
        assert client.fetch(srv.endpoint, "7/0") is None
        slow["on"] = False
        time.sleep(0.7)  # past the backoff; the late answer to the first request is never read
        got = client.fetch(srv.endpoint, "8/0")
        assert got is not None and got.key == "8/0"
        assert client.failures == {"timeout": 1}
    finally:
        srv.close()


def test_the_backoff_doubles_with_each_failure_in_a_row_up_to_backoff_s_and_an_answer_resets_it(table):
    c = VectorClient(timeout_ms=200, backoff_s=0.5, backoff_initial_s=0.2)
    dead = ("127.0.0.1", _free_port())
    lefts = []
    for _ in range(3):
        time.sleep(c.backoff_left(dead) + 0.01)
        assert c.fetch(dead, "7/0") is None
        lefts.append(c.backoff_left(dead))
    assert 0.15 < lefts[0] <= 0.2 and 0.35 < lefts[1] <= 0.4 and 0.45 < lefts[2] <= 0.5, lefts
    assert c.failures == {"timeout": 3}

    srv, slow = _slow_server(table, 0.4)
    try:
        assert c.fetch(srv.endpoint, "7/0") is None  # one timeout: a short skip
        assert 0.15 < c.backoff_left(srv.endpoint) <= 0.2
        slow["on"] = False
        time.sleep(0.45)
        assert c.fetch(srv.endpoint, "7/0") is not None  # it answered: the count starts afresh
        slow["on"] = True
        assert c.fetch(srv.endpoint, "8/0") is None
        assert 0.15 < c.backoff_left(srv.endpoint) <= 0.2
    finally:
        srv.close()
        c.close()


def test_retry_s_waits_out_a_short_backoff_and_gets_the_late_answer(table):
    calls = []

    def busy_once(key):  # a prefill rank busy for a moment, as a 2-core machine makes it
        calls.append(key)
        if len(calls) == 1:
            time.sleep(0.5)
        return table.get(key)

    srv = VectorServer(busy_once, bind="127.0.0.1", max_request_bytes=256)
    srv.start()
    patient = VectorClient(timeout_ms=200, backoff_s=5.0, backoff_initial_s=0.5)
    hasty = VectorClient(timeout_ms=200, backoff_s=5.0, backoff_initial_s=0.5)
    try:
        got = patient.fetch(srv.endpoint, "7/0", retry_s=3.0)
        assert got is not None and got.key == "7/0"
        assert patient.failures == {"timeout": 1}
        calls.clear()
        assert hasty.fetch(srv.endpoint, "7/0") is None  # retry_s 0: one try
        assert hasty.failures == {"timeout": 1}
    finally:
        srv.close()
        patient.close()
        hasty.close()


def test_retry_s_asks_again_for_a_room_prefill_has_not_published_yet(server, table):
    c = VectorClient(timeout_ms=300, backoff_initial_s=0.2)
    threading.Timer(0.1, lambda: table.__setitem__("9/0", digest("9/0", 9))).start()
    try:
        got = c.fetch(server.endpoint, "9/0", retry_s=2.0)
        assert got is not None and got.key == "9/0"
        assert c.failures == {"not_found": 1}
    finally:
        c.close()


def test_retry_s_gives_up_when_the_next_try_would_come_after_it():
    c = VectorClient(timeout_ms=200, backoff_s=5.0, backoff_initial_s=0.2)
    dead = ("127.0.0.1", _free_port())
    started = time.monotonic()
    assert c.fetch(dead, "7/0", retry_s=0.5) is None  # fails, waits 0.2 s, fails; the next skip is 0.4 s
    took = time.monotonic() - started
    assert c.failures == {"timeout": 2}
    assert 0.2 <= took < 0.5
    assert c.fetch(dead, "7/0", retry_s=0.1) is None and c.failures["peer_down"] == 1  # skipped, no wait
    c.close()


def test_a_dead_peer_is_waited_for_once_and_an_unknown_room_asked_for_once_more(server):
    c = VectorClient(timeout_ms=200, backoff_s=5.0, backoff_initial_s=0.1)
    dead = ("127.0.0.1", _free_port())
    started = time.monotonic()
    assert c.fetch(dead, "7/0", retry_s=10.0) is None  # 3 tries, 0.1 + 0.2 s apart, then it stops waiting
    assert c.failures == {"timeout": 3} and time.monotonic() - started < 2.0
    started = time.monotonic()
    assert c.fetch(dead, "7/0", retry_s=10.0) is None  # the next room: no wait at all
    assert c.failures == {"timeout": 3, "peer_down": 1} and time.monotonic() - started < 0.05
    started = time.monotonic()
    assert c.fetch(server.endpoint, "404/0", retry_s=10.0) is None  # prefill has no such room
    assert c.failures["not_found"] == 2 and time.monotonic() - started < 2.0
    c.close()


def test_oversized_and_malformed_requests_are_refused_and_serving_goes_on(server, client):
    assert raw_request(server.endpoint, b"x" * 4096) is None  # over max_request_bytes: closed before it is read
    answer = raw_request(server.endpoint, b'{"v": 1, "id": 3, "key": 5}')
    with pytest.raises(ExchangeError, match=r"Expected `str`, got `int` - at `\$.key`"):
        decode_response(answer)
    assert server.counts == {"refused_too_big": 1, "refused_request": 1} and server.refused == 2
    assert client.fetch(server.endpoint, "7/0").key == "7/0"


def test_concurrent_clients_are_each_answered(server, table):
    results = {}

    def ask(key):
        c = VectorClient(timeout_ms=2000)
        results[key] = c.fetch(server.endpoint, key)
        c.close()

    threads = [threading.Thread(target=ask, args=(k,)) for k in ("7/0", "8/0")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: v.key for k, v in results.items()} == {"7/0": "7/0", "8/0": "8/0"}


def test_bind_needs_an_address():
    with pytest.raises(ValueError, match="exchange.bind"):
        VectorServer(dict().get, bind="")


def test_request_decoding_names_the_problem():
    assert decode_request(encode_request(4, "1/0"), 64) == (4, "1/0")
    with pytest.raises(ExchangeError, match="exceeds max_request_bytes=8"):
        decode_request(encode_request(4, "1/0"), 8)
    with pytest.raises(ExchangeError, match=r"Expected `int`, got `str` - at `\$.id`"):
        decode_request(b'{"v": 1, "id": "4", "key": "1/0"}', 64)
    with pytest.raises(ExchangeError, match="not JSON"):
        decode_request(b"\xff", 64)


def test_response_round_trip_and_refusal():
    d = digest("5/0")
    rid, got = decode_response(encode_response(9, d))
    assert rid == 9 and got.room == d.room
    assert decode_response(encode_response(9, None)) == (9, None)
    with pytest.raises(ExchangeError, match="peer refused the request: too big"):
        decode_response(encode_response(9, error="too big"))


@pytest.mark.parametrize("host, port, expected", [
    ("10.1.2.3", 40000, ("10.1.2.3", 40000)),
    ("0.0.0.0", 5, (None, 5)),
    ("fe80::1", 6000, (None, 6000)),
    (None, 65535, (None, 65535)),
])
def test_endpoint_slot_round_trip(host, port, expected):
    value = pack_endpoint(host, port)
    assert 0 <= value < 2**64
    assert unpack_endpoint(value) == expected


@pytest.mark.parametrize("value", [0, 7, 2**64 - 1, 0x1D4B_0000_0000_0001])
def test_foreign_slot_values_are_not_endpoints(value):
    assert unpack_endpoint(value) is None


def test_a_client_from_the_config_takes_its_timeouts_backoff_and_secret(tmp_path):
    from dsv4_idxk_probe.config import parse_config

    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    exchange = parse_config({"exchange": {"timeout_ms": 77, "backoff_s": 9.0, "backoff_initial_s": 0.5,
                                          "secret_file": str(secret)}}).exchange
    client = VectorClient.from_config(exchange, metrics="m")
    assert (client.timeout_ms, client.backoff_s, client.backoff_initial_s, client.metrics) == (77, 9.0, 0.5, "m")
    assert client.secret == b"s" * 32


def test_a_silent_peer_holds_up_only_the_fetches_that_ask_it(server, table):
    """Decode fetches from many prefill ranks on several threads (the prefetch workers, the
    collector): one whose peer accepted the connection and says nothing waits out its own
    deadline, while a fetch from another peer started meanwhile is answered at once."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts (the kernel does), never greets
    c = VectorClient(timeout_ms=20_000, backoff_s=0.5)
    stuck_done = threading.Event()

    def ask_the_silent_one():
        c.fetch(silent.getsockname(), "7/0")
        stuck_done.set()

    stuck = threading.Thread(target=ask_the_silent_one, daemon=True)
    conn = None
    try:
        stuck.start()
        silent.settimeout(20)
        conn, _ = silent.accept()  # its fetch has connected and waits for the greeting
        assert c.fetch(server.endpoint, "8/0").key == "8/0"
        # answered while the other fetch still waited: its timeout is not counted yet
        assert not stuck_done.is_set() and "timeout" not in c.failures, c.failures
    finally:
        for sock in (conn, silent):
            if sock is not None:
                sock.close()
        stuck_done.wait(25)
        c.close()
    assert stuck_done.is_set() and c.failures == {"timeout": 1}


def test_every_failure_kind_of_a_client_is_created_at_zero_with_it():
    """An alert reads `increase(exchange_errors_total[10m])`, which cannot see a series' first
    value: each kind the client counts exists at zero from the start, and no kind is counted
    that was not created so."""
    import inspect
    import re

    from prometheus_client import CollectorRegistry

    from dsv4_idxk_probe.exchange import client as client_module
    from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

    counted = set(re.findall(r'_fail\("([a-z_]+)"\)', inspect.getsource(client_module)))
    assert counted and counted <= set(client_module.CLIENT_KINDS), counted - set(client_module.CLIENT_KINDS)
    registry = CollectorRegistry()
    c = VectorClient(timeout_ms=300, metrics=ProbeMetrics(registry, role="decode"))
    try:
        series = {s.labels["kind"]: s.value for f in registry.collect() for s in f.samples
                  if s.name == "dsv4_idxk_probe_exchange_errors_total"}
        assert {k: series.get(k) for k in client_module.CLIENT_KINDS} == dict.fromkeys(client_module.CLIENT_KINDS, 0.0)
        assert c.fetch(None, "7/0") is None
        series = {s.labels["kind"]: s.value for f in registry.collect() for s in f.samples
                  if s.name == "dsv4_idxk_probe_exchange_errors_total"}
        assert series["no_endpoint"] == 1.0
    finally:
        c.close()
