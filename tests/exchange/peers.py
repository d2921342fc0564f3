"""Processes for the flood tests: a VectorServer child whose memory and descriptors
are its own, and a zmq attacker child (its unsent queue must not count as the server's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER = r"""
import json, os, resource, sys
import numpy as np
soft = int(sys.argv[1])
if soft:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from dsv4_idxk_probe.digest.result import RoomDigest
from dsv4_idxk_probe.exchange import VectorServer
d = RoomDigest(key="7/0", signature=1, n_tokens=64, layer_ids=(1,), segments=("payload",),
               layer_segment=np.ones((1, 1), dtype=np.uint64), pages=np.ones(1, dtype=np.uint64))
secret = sys.argv[2].encode() or None
srv = VectorServer({"7/0": d}.get, bind="127.0.0.1", secret=secret, max_request_bytes=4096,
                   max_connections=int(sys.argv[3]), handshake_s=float(sys.argv[4]))
srv.start()
print(srv.port, flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "stats":
        print(json.dumps({"counts": srv.counts, "connections": srv.connections, "served": srv.served,
                          "alive": srv.thread.is_alive()}), flush=True)
    elif cmd == "open":
        try:
            with open(os.devnull):
                print("ok", flush=True)
        except OSError as exc:
            print(f"error {exc.errno}", flush=True)
    elif cmd == "quit":
        break
srv.close()
"""

ATTACKER = r"""
import sys, time, zmq
port, frames, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(f"tcp://127.0.0.1:{port}")
payload = sys.argv[4].encode() if len(sys.argv) > 4 else b"x" * size
sent = 0
for _ in range(frames):
    try:
        sock.send(payload, zmq.SNDMORE | zmq.NOBLOCK)
        sent += 1
    except zmq.Again:
        break
print(sent, flush=True)
sys.stdin.readline()  # stay connected, the message never finished, until told to go
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class ServerChild:
    def __init__(self, *, nofile: int = 0, secret: str = "", max_connections: int = 64, handshake_s: float = 2.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(nofile), secret, str(max_connections), str(handshake_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
        )
        self.port = int(self.proc.stdout.readline())
        self.endpoint = ("127.0.0.1", self.port)

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stats(self) -> dict:
        return json.loads(self.ask("stats"))

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()


class ZmqAttacker:
    """A zmq DEALER child that sends `frames` frames of `size` bytes with MORE set and never finishes."""

    def __init__(self, port: int, frames: int, size: int, payload: bytes | None = None):
        args = [sys.executable, "-c", ATTACKER, str(port), str(frames), str(size)]
        if payload is not None:
            args.append(payload.decode())
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        self.sent = int(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
