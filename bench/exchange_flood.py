"""Resident memory and descriptors of a prefill VectorServer under issue 17's floods.

The server runs in a child process (its memory is its own; the attackers'
unsent queues stay in theirs), with the shipped defaults (64 connections, 16
unauthenticated, 4096-byte requests, a shared secret). Phases, each followed
by a real authenticated fetch that must succeed:

  nested    1,000 frames of b"[" * 3000 from a zmq DEALER, and 1,000 from an authenticated peer
  multipart a zmq DEALER sends 150,000 frames of 4,000 B with MORE set and never finishes
  stalled   64 authenticated peers each announce a 4,096-byte request, send 4,000 B and stall
  idle      244 idle TCP connections, then 2,000 connect/close cycles
  unauth    1,000 handshakes with a wrong secret

    python -m bench.exchange_flood [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO
from dsv4_idxk_probe.exchange import VectorClient, auth
from dsv4_idxk_probe.exchange.client import raw_request

SECRET = b"bench secret of the exchange flood"
MIB = 1 << 20

SERVER = r"""
import json, sys
import numpy as np
from dsv4_idxk_probe.digest.result import RoomDigest
from dsv4_idxk_probe.exchange import VectorServer
pages = np.arange(2048, dtype=np.uint64)  # a 128k-token room's page vector
d = RoomDigest(key="7/0", signature=1, n_tokens=131072, layer_ids=tuple(range(61)), segments=("payload", "scale"),
               layer_segment=np.ones((61, 2), dtype=np.uint64), pages=pages)
srv = VectorServer({"7/0": d}.get, bind="127.0.0.1", secret=sys.argv[1].encode())
srv.start()
print(srv.port, flush=True)
for line in sys.stdin:
    if line.strip() == "stats":
        print(json.dumps({"counts": srv.counts, "connections": srv.connections, "alive": srv.thread.is_alive()}), flush=True)
    else:
        break
srv.close()
"""

ATTACKER = r"""
import sys, zmq
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
payload, sent = b"x" * int(sys.argv[3]), 0
for _ in range(int(sys.argv[2])):
    try:
        sock.send(payload, zmq.SNDMORE | zmq.NOBLOCK)
        sent += 1
    except zmq.Again:
        break
print(sent, flush=True)
sys.stdin.readline()
"""


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


class Child:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, SECRET.decode()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env())
        self.port = int(self.proc.stdout.readline())
        self.peak = 0

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            value = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        self.peak = max(self.peak, value)
        return value

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(10)


def fetch_ms(port: int) -> float | None:
    client = VectorClient(timeout_ms=5000, secret=SECRET)
    started = time.perf_counter()
    got = client.fetch(("127.0.0.1", port), "7/0")
    client.close()
    return round((time.perf_counter() - started) * 1000, 2) if got is not None else None


def authed_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    hello = sock.recv(auth.SERVER_HELLO)
    sock.sendall(auth.client_proof(SECRET, hello[4:], auth.new_nonce()))
    sock.recv(auth.MAC)
    return sock


def sample_while(child: Child, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        child.rss()
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()
    import logging

    import zmq

    logging.basicConfig(level=logging.ERROR)  # the wrong-secret phase warns once per client: 1,000 lines

    child = Child()
    time.sleep(0.5)
    out = {"baseline_rss_mib": round(child.rss() / MIB, 1), "baseline_fds": child.fds(), "phases": {}}

    def phase(name, run):
        before = child.rss()
        started = time.perf_counter()
        extra = run() or {}
        seconds = time.perf_counter() - started
        out["phases"][name] = {
            "seconds": round(seconds, 2), "rss_before_mib": round(before / MIB, 1),
            "rss_peak_so_far_mib": round(child.peak / MIB, 1), "rss_after_mib": round(child.rss() / MIB, 1),
            "fds_after": child.fds(), "fetch_after_ms": fetch_ms(child.port), **extra,
        }

    def nested():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{child.port}")
        for _ in range(1000):
            try:
                sock.send(b"[" * 3000, zmq.NOBLOCK)
            except zmq.Again:
                pass
        sample_while(child, 1.0)
        sock.close(0)
        refused = sum(raw_request(("127.0.0.1", child.port), b"[" * 3000, secret=SECRET) is not None for _ in range(1000))
        return {"authenticated_refusals_answered": refused}

    def multipart():
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(child.port), "150000", "4000"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env())
        sent = int(attacker.stdout.readline())
        sample_while(child, 3.0)
        attacker.stdin.write("\n")
        attacker.stdin.flush()
        attacker.wait(10)
        return {"frames_queued_by_attacker": sent}

    def stalled():
        socks = []
        for _ in range(64):
            try:
                s = authed_socket(child.port)
                s.sendall(auth.HEADER.pack(4096) + b"x" * 4000)
                socks.append(s)
            except OSError:
                pass
        sample_while(child, 1.0)
        held = len(socks)
        for s in socks:
            s.close()
        return {"stalled_peers_held": held}

    def idle():
        socks = [socket.create_connection(("127.0.0.1", child.port)) for _ in range(244)]
        sample_while(child, 0.5)
        during = {"fds_during": child.fds(), "connections_during": child.stats()["connections"],
                  "fetch_during_ms": fetch_ms(child.port)}
        for s in socks:
            s.close()
        for _ in range(2000):
            socket.create_connection(("127.0.0.1", child.port)).close()
        return during

    def unauth():
        wrong = b"not the secret of this exchange"
        for _ in range(1000):
            c = VectorClient(timeout_ms=2000, secret=wrong)
            c.fetch(("127.0.0.1", child.port), "7/0")
            c.close()

    for name, run in (("nested", nested), ("multipart", multipart), ("stalled", stalled), ("idle", idle),
                      ("unauth", unauth)):
        phase(name, run)
    out["server"] = child.stats()
    out["peak_rss_mib"] = round(child.peak / MIB, 1)
    child.close()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
