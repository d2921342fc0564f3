"""Tests for the NIXL transport: real NIXL over UCX between spawned processes.

Why spawned processes: the rig's prefill and decode are separate processes, and
NIXL or UCX state must not leak into the pytest process, where a stuck native
call could not be interrupted. Every wait here has a deadline; children that
outlive it are killed and the test fails.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
import traceback

import numpy as np
import pytest

pytest.importorskip("nixl")

from dsv4_idxk_probe.testbed.builtin import transport as tp

ROW_BYTES = 8448  # one index-K page row, as in the rig
STEP_TIMEOUT_S = 15.0
CTX = mp.get_context("spawn")


# -- helpers that run in the children -----------------------------------------


def _to_kind(arrays, kind):
    """Turn numpy arrays into what the endpoint under test should register."""
    if kind == "numpy":
        return [a.copy() for a in arrays]
    import torch

    device = "cuda" if kind == "torch-cuda" else "cpu"
    return [torch.from_numpy(a.copy()).to(device) for a in arrays]


def _to_numpy(buffers):
    """Copy registered buffers back to numpy for the parent to compare."""
    return [b.cpu().numpy() if hasattr(b, "cpu") else np.array(b) for b in buffers]


def _report(conn, fn):
    """Run fn and send ('ok', value) or ('error', text) to the parent."""
    try:
        conn.send(("ok", fn()))
    except BaseException as exc:  # the parent must hear about every failure
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def receiver_main(conn, initial, kind, notif, exit_on_cue):
    """Register buffers, publish metadata, wait for the notification, send buffers back.

    With exit_on_cue it instead waits for the parent's cue and exits, to play a dead peer.
    """

    def body():
        buffers = _to_kind(initial, kind)
        with tp.NixlEndpoint("decode", buffers) as ep:
            tp.send_metadata(conn, ep.metadata())
            if exit_on_cue:
                conn.poll(STEP_TIMEOUT_S)
                return None
            peer, msg = ep.wait_notification(notif, timeout=STEP_TIMEOUT_S)
            return peer, msg, _to_numpy(buffers)

    _report(conn, body)


def sender_main(conn, src, kind, pairs, notif, limit):
    """Connect to the receiver and WRITE the given rows, with the notification."""

    def body():
        buffers = _to_kind(src, kind)
        with tp.NixlEndpoint("prefill", buffers) as ep:
            peer = ep.connect(tp.recv_metadata(conn, timeout=STEP_TIMEOUT_S))
            handle = ep.write_rows(peer, pairs, notif, byte_limit_per_row=limit)
            ep.wait(handle, timeout=STEP_TIMEOUT_S)
            return handle.state

    _report(conn, body)


def dead_peer_main(conn, connect_first):
    """Try to reach a receiver whose process has exited; return the error seen."""

    def body():
        src = np.ones((4, ROW_BYTES), np.uint8)
        with tp.NixlEndpoint("prefill", [src]) as ep:
            md = tp.recv_metadata(conn, timeout=STEP_TIMEOUT_S)
            try:
                if connect_first:
                    peer = ep.connect(md)
                    conn.send("connected")
                    conn.recv()  # parent says the receiver is gone
                else:
                    conn.recv()  # receiver gone before we connect
                    peer = ep.connect(md)
                ep.wait(ep.write_rows(peer, [(0, 0, 0)], b"x"), timeout=5.0)
            except tp.TransportError as exc:
                return type(exc).__name__, str(exc)
            return None

    _report(conn, body)


def bad_input_main(conn):
    """Two endpoints in one process: every bad call must raise, quickly, with a message."""

    def body():
        a = np.zeros((4, ROW_BYTES), np.uint8)
        b = np.zeros((8, ROW_BYTES), np.uint8)
        with tp.NixlEndpoint("prefill", [a]) as send, tp.NixlEndpoint("decode", [b]) as recv:
            peer = send.connect(recv.metadata())
            forged = json.loads(recv.metadata())
            forged["name"], forged["buffers"][0]["rows"] = "decode", 1000
            calls = {
                "dst_row": lambda: send.write_rows(peer, [(0, 0, 8)], b"n"),
                "src_row": lambda: send.write_rows(peer, [(0, 4, 0)], b"n"),
                "neg_row": lambda: send.write_rows(peer, [(0, -1, 0)], b"n"),
                "buffer": lambda: send.write_rows(peer, [(1, 0, 0)], b"n"),
                "limit_zero": lambda: send.write_rows(peer, [(0, 0, 0)], b"n", byte_limit_per_row=0),
                "limit_big": lambda: send.write_rows(peer, [(0, 0, 0)], b"n", byte_limit_per_row=ROW_BYTES + 1),
                "no_pairs": lambda: send.write_rows(peer, [], b"n"),
                "unknown_peer": lambda: send.write_rows("nobody", [(0, 0, 0)], b"n"),
                "garbage_md": lambda: send.connect(b"not json"),
                "self_md": lambda: send.connect(send.metadata()),
                "no_notif": lambda: recv.wait_notification(b"never", timeout=0.3),
            }
            results = {}
            for key, call in calls.items():
                t0 = time.monotonic()
                try:
                    call()
                    results[key] = ("no error", "", time.monotonic() - t0)
                except (ValueError, tp.TransportError) as exc:
                    results[key] = (type(exc).__name__, str(exc), time.monotonic() - t0)
            # NIXL's own check: metadata that claims rows the peer never registered.
            send.connect(json.dumps(forged).encode())
            try:
                send.write_rows(peer, [(0, 0, 999)], b"n")
                results["nixl_bounds"] = ("no error", "", 0.0)
            except tp.TransportError as exc:
                results["nixl_bounds"] = (type(exc).__name__, str(exc), 0.0)
            # The loopback write still works between two agents of one process.
            send.connect(recv.metadata())
            a[2] = 7
            send.wait(send.write_rows(peer, [(0, 2, 5)], b"ok"), timeout=5.0)
            got = recv.wait_notification(b"ok", timeout=5.0)
            results["same_process"] = (got, bool((b[5] == 7).all()), int(b.sum()) == 7 * ROW_BYTES)
            return results

    _report(conn, body)


# -- helpers in the pytest process --------------------------------------------


def _recv(conn, what, timeout=STEP_TIMEOUT_S):
    """Receive one message from a child or fail the test after timeout."""
    if not conn.poll(timeout):
        pytest.fail(f"no message from {what} within {timeout}s")
    return conn.recv()


def _recv_metadata(conn, what):
    """Receive a child's metadata, or fail with the child's own error if it sent one."""
    msg = _recv(conn, what)
    if isinstance(msg, tuple):
        _unwrap(msg, what)
        pytest.fail(f"{what} sent {msg!r} instead of metadata")
    return msg


def _unwrap(msg, what):
    """Return a child's result or fail with its traceback."""
    status, value = msg
    if status != "ok":
        pytest.fail(f"{what} failed:\n{value}")
    return value


def _stop(*procs):
    """Join children briefly, then kill any that hang."""
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _run_pair(src, initial, pairs, notif, kind="numpy", limit=None):
    """Run a receiver and a sender process; return the receiver's (peer, msg, buffers)."""
    r_parent, r_child = CTX.Pipe()
    s_parent, s_child = CTX.Pipe()
    recv_p = CTX.Process(target=receiver_main, args=(r_child, initial, kind, notif, False))
    send_p = CTX.Process(target=sender_main, args=(s_child, src, kind, pairs, notif, limit))
    try:
        recv_p.start()
        send_p.start()
        tp.send_metadata(s_parent, _recv_metadata(r_parent, "receiver"))
        assert _unwrap(_recv(s_parent, "sender"), "sender") == "DONE"
        return _unwrap(_recv(r_parent, "receiver"), "receiver")
    finally:
        _stop(send_p, recv_p)


def _make_buffers(seed, rows=(16, 12)):
    """Random source buffers and a different random receiver pattern, same geometry."""
    rng = np.random.default_rng(seed)
    src = [rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8) for n in rows]
    initial = [rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8) for n in rows]
    return src, initial


def _expected(src, initial, pairs, limit=None):
    """What the receiver's buffers must hold after the WRITE."""
    out = [a.copy() for a in initial]
    k = ROW_BYTES if limit is None else limit
    for b, s, d in pairs:
        out[b][d, :k] = src[b][s, :k]
    return out


# Non-contiguous rows, reversed order, both buffers, first and last rows.
PAIRS = [(0, 1, 9), (0, 2, 0), (0, 15, 15), (0, 7, 3), (1, 0, 11), (1, 11, 0), (1, 5, 6), (1, 6, 5)]


def _cuda_available():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


KINDS = [
    "numpy",
    "torch-cpu",
    pytest.param("torch-cuda", marks=pytest.mark.skipif(not _cuda_available(), reason="no CUDA device")),
]


# -- tests ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_rows_land_exactly_where_written(kind):
    if kind.startswith("torch"):
        pytest.importorskip("torch")
    src, initial = _make_buffers(seed=1)
    notif = b"idxk:req-7:pages=8"
    peer, msg, got = _run_pair(src, initial, PAIRS, notif, kind=kind)
    assert (peer, msg) == ("prefill", notif)
    for b, (g, want) in enumerate(zip(got, _expected(src, initial, PAIRS))):
        bad = np.flatnonzero((g != want).any(axis=1))
        assert bad.size == 0, f"buffer {b}: rows {bad.tolist()} differ from expected"


def test_partial_write_lands_only_first_k_bytes():
    src, initial = _make_buffers(seed=2)
    pairs, k = [(0, 3, 4), (1, 8, 2)], 1000
    _, _, got = _run_pair(src, initial, pairs, b"partial", limit=k)
    want = _expected(src, initial, pairs, limit=k)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert (got[0][4, k:] == initial[0][4, k:]).all(), "bytes past K must keep the receiver's old data"
    assert not (got[0][4, :k] == initial[0][4, :k]).all(), "first K bytes must have been overwritten"


@pytest.mark.parametrize("connect_first", [False, True], ids=["dead-before-connect", "dead-after-connect"])
def test_dead_peer_gives_clear_error(connect_first):
    r_parent, r_child = CTX.Pipe()
    s_parent, s_child = CTX.Pipe()
    recv_p = CTX.Process(target=receiver_main, args=(r_child, [np.zeros((4, ROW_BYTES), np.uint8)], "numpy", b"", True))
    send_p = CTX.Process(target=dead_peer_main, args=(s_child, connect_first))
    t0 = time.monotonic()
    try:
        recv_p.start()
        send_p.start()
        tp.send_metadata(s_parent, _recv_metadata(r_parent, "receiver"))
        if connect_first:
            assert _recv(s_parent, "sender") == "connected"
        r_parent.send("exit")
        assert _unwrap(_recv(r_parent, "receiver"), "receiver") is None
        recv_p.join(timeout=10)
        assert recv_p.exitcode == 0, "receiver must have exited"
        s_parent.send("receiver gone")
        result = _unwrap(_recv(s_parent, "sender"), "sender")
    finally:
        _stop(send_p, recv_p)
    assert result is not None, "writing to a dead peer must raise, not succeed"
    name, text = result
    assert name == "PeerError"
    assert "decode" in text and "NIXL_ERR" in text, text
    assert time.monotonic() - t0 < 25


def test_bad_inputs_raise_clear_errors():
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=bad_input_main, args=(child,))
    try:
        proc.start()
        results = _unwrap(_recv(parent, "bad-input child", timeout=25), "bad-input child")
    finally:
        _stop(proc)
    expect = {
        "dst_row": ("ValueError", "dst row 8 out of range"),
        "src_row": ("ValueError", "src row 4 out of range"),
        "neg_row": ("ValueError", "src row -1 out of range"),
        "buffer": ("ValueError", "buffer index 1 out of range"),
        "limit_zero": ("ValueError", "byte_limit_per_row=0"),
        "limit_big": ("ValueError", f"byte_limit_per_row={ROW_BYTES + 1}"),
        "no_pairs": ("ValueError", "at least one"),
        "unknown_peer": ("PeerError", "not connected to peer 'nobody'"),
        "garbage_md": ("ValueError", "not a transport metadata blob"),
        "self_md": ("ValueError", "own name"),
        "no_notif": ("TransportTimeout", "no b'never'"),
        "nixl_bounds": ("TransportError", "NIXL_ERR_NOT_FOUND"),
    }
    for key, (cls, fragment) in expect.items():
        got_cls, text, took = results[key]
        assert got_cls == cls and fragment in text, f"{key}: got {got_cls}: {text!r}"
        assert took < 2.0, f"{key}: took {took:.1f}s"
    (peer, msg), row_ok, nowhere_else = results["same_process"]
    assert (peer, msg, row_ok, nowhere_else) == ("prefill", b"ok", True, True)


def test_metadata_helpers_time_out_instead_of_hanging(tmp_path):
    a, _b = CTX.Pipe()
    with pytest.raises(tp.TransportTimeout, match="pipe"):
        tp.recv_metadata(a, timeout=0.2)
    q = CTX.Queue()
    with pytest.raises(tp.TransportTimeout, match="queue"):
        tp.recv_metadata(q, timeout=0.2)
    path = tmp_path / "decode.md"
    with pytest.raises(tp.TransportTimeout, match="did not appear"):
        tp.read_metadata_file(path, timeout=0.2)
    tp.write_metadata_file(path, b"blob")
    assert tp.read_metadata_file(path, timeout=0.2) == b"blob"
    q.put(b"via-queue")
    assert tp.recv_metadata(q, timeout=5) == b"via-queue"
