"""A request whose prefill leg the router loses: decode waits, the client hears nothing.

Why: SGLang-rig runs lost a few requests that reached decode through the
router but never reached prefill (prefill logged no ``Receive`` for them);
decode then waited in ``KVPoll.WaitingForInput`` until SGLang's waiting
timeout. This shows that path with the probe off: SGLang's router (PD mode)
sends each request to prefill and decode at once and answers the client from
decode alone; when the prefill leg's connection fails after the request was
sent, nothing tells decode, which waits for a KV transfer that never comes.

One rig pair runs with ``DSV4_IDXK_PROBE=0``. A second SGLang router is put in
front of the pair, its prefill URL pointing at a small TCP proxy that passes
every connection to prefill except the requests chosen to be lost: for those
it reads the request and closes the connection without an answer (what a
connection reset or a server that died mid-request does). Decode's waiting
timeout is shortened (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``) so the run
ends in minutes.

Usage:  python -m bench.router_prefill_loss [--requests 8] [--lose 3] [--waiting-timeout-s 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import command_line, write_result
from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.run import RigSession


class DroppingProxy:
    """TCP proxy to `target`; the HTTP requests whose body names a rid in `lose` are read
    and their connection closed without an answer (other connections pass through)."""

    def __init__(self, target: int, lose: set[str]):
        self.target = target
        self.lose = lose
        self.dropped: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        buffered = b""
        try:
            while chunk := client.recv(65536):
                buffered = (buffered + chunk)[-4096:]  # the rid is in the body's first bytes of its tail
                hit = next((rid for rid in self.lose if f'"rid": "{rid}"'.encode() in buffered
                            or f'"rid":"{rid}"'.encode() in buffered), None)
                if hit is not None:
                    self.lose.discard(hit)
                    self.dropped.append(hit)
                    client.close()
                    upstream.close()
                    return
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass


def run(args: argparse.Namespace, out_dir: Path) -> dict:
    env = dict(os.environ, SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(args.waiting_timeout_s))
    options = launch.ServerOptions(extra_prefill=("--log-requests",), extra_decode=("--log-requests",))
    plan = workload.plan("loss", workload.WorkloadOptions(rooms=args.requests, min_prompt=64, max_prompt=600,
                                                          min_new_tokens=4, max_new_tokens=8))
    lose = {plan[i - 1].rid for i in args.lose}
    session = RigSession(out_dir, options, probe_mode="0", env=env)
    router = None
    try:
        session.start()
        session._write_plan({r.rid: r.number for r in plan}, None)
        ports = session.cluster.ports
        proxy = DroppingProxy(ports.prefill, set(lose))
        router_port, metrics_port = launch.free_ports(2)
        router_log = out_dir / "router-via-proxy.log"
        with open(router_log, "wb") as log:
            router = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                 "--prefill", f"http://127.0.0.1:{proxy.port}", str(ports.bootstrap),
                 "--decode", f"http://127.0.0.1:{ports.decode}", "--host", "127.0.0.1", "--port", str(router_port),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if launch.http_get(url + "/workers", timeout=2.0)[0] == 200:
                    break
            except Exception:
                pass
            time.sleep(1.0)
        time.sleep(5.0)  # the router checks its workers' health in the background
        outcomes = workload.send(url, plan, concurrency=2, timeout_s=args.waiting_timeout_s * 3 + 60)
        time.sleep(2.0)
        logs = {role: session.cluster.logs[role].read_text(errors="replace") for role in ("prefill", "decode")}
        rows = []
        for o in outcomes:
            rid = o.request.rid
            rows.append({"rid": rid, "lost_on_purpose": rid in lose, "status": o.status, "seconds": round(o.seconds, 1),
                         "error": o.error[:200], "prefill_logged": rid in logs["prefill"],
                         "decode_logged": rid in logs["decode"]})
        router_lines = [line[:300] for line in router_log.read_text(errors="replace").splitlines()
                        if "rror" in line or "ail" in line][-10:]
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
        session.stop()
    return {"command": command_line("router_prefill_loss", args.argv), "waiting_timeout_s": args.waiting_timeout_s,
            "dropped_by_proxy": proxy.dropped, "requests": rows, "router_error_lines": router_lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_prefill_loss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--lose", type=int, nargs="+", default=[3], help="request numbers whose prefill leg is lost")
    parser.add_argument("--waiting-timeout-s", type=int, default=40)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="router-loss-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = run(args, out_dir)
    for row in result["requests"]:
        print(f"{row['rid']:>10}  lost-on-purpose={row['lost_on_purpose']!s:5}  status={row['status']}  "
              f"{row['seconds']:>6} s  prefill saw it: {row['prefill_logged']!s:5}  decode saw it: {row['decode_logged']!s:5}"
              f"  {row['error'][:80]}")
    for line in result["router_error_lines"]:
        print(f"  router: {line}")
    write_result(out_dir, "router_prefill_loss.json", result)
    print(f"details: {out_dir / 'router_prefill_loss.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
