"""A Mooncake store master for the test beds: the `mooncake_master` that ships in the Mooncake
wheel, with its RPC, HTTP metadata and admin servers all on loopback, so SGLang's
`MooncakeStore` (HiCache's zero-copy storage tier) runs against a real store over TCP.

Its admin server lists the keys stored (`keys`): how a test sees which pages reached L3."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .launch import free_ports, http_get

LOOPBACK = "127.0.0.1"


class MasterError(RuntimeError):
    """The master is not installed, exited, or never listened."""


@dataclass(frozen=True)
class MooncakeMaster:
    address: str  # host:port of its RPC server, what clients' `master_server_address` names
    metadata_url: str  # its HTTP metadata server, what clients' `metadata_server` names
    admin_url: str

    def keys(self) -> list[str]:
        """Every key the store holds now."""
        status, body = http_get(f"{self.admin_url}/get_all_keys", timeout=10)
        if status != 200:
            raise MasterError(f"the master's key list answered HTTP {status}")
        return [line for line in body.decode().splitlines() if line.strip()]


def master_binary() -> str:
    """The master beside this interpreter (the wheel's console script), else on PATH."""
    found = shutil.which("mooncake_master", path=os.path.dirname(sys.executable)) or shutil.which("mooncake_master")
    if found is None:
        raise MasterError("mooncake_master not found: the Mooncake wheel of requirements/ is not installed")
    return found


def _listening(port: int) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), timeout=1).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def running_master(log_path: Path, start_timeout_s: float = 60.0) -> Iterator[MooncakeMaster]:
    """A master for the block's duration, its output in `log_path`; stopped on exit."""
    rpc, http, admin = free_ports(3)  # below the ephemeral range the servers' own binds come from
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [master_binary(), "-rpc_address", LOOPBACK, f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
             "-http_metadata_server_host", LOOPBACK, f"-http_metadata_server_port={http}",
             "-metrics_host", LOOPBACK, f"-metrics_port={admin}", "-enable_metric_reporting=false"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not all(_listening(port) for port in (rpc, http, admin)):
                if proc.poll() is not None:
                    raise MasterError(f"mooncake_master exited with {proc.returncode} (its log: {log_path})")
                if time.monotonic() > deadline:
                    raise MasterError(f"mooncake_master did not listen within {start_timeout_s:.0f} s (its log: {log_path})")
                time.sleep(0.2)
            yield MooncakeMaster(f"{LOOPBACK}:{rpc}", f"http://{LOOPBACK}:{http}/metadata", f"http://{LOOPBACK}:{admin}")
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
