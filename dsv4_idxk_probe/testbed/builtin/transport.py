"""NIXL WRITE transport for the local prefill/decode (PD) rig.

Why this exists: the rig must move index-K pages between a prefill process and
a decode process over the same path SGLang's NIXL backend uses in production
(a one-sided NIXL WRITE over UCX that carries a completion notification), so
that a fault seen in the rig is a fault of the data, not of a stand-in copy.
The raw ``nixl`` API speaks in addresses and descriptor lists; this module
speaks in (buffer, row) pairs, which is how the rig thinks about pages, and
turns NIXL's status codes and exceptions into errors that say what failed.

Shape of a transfer::

    decode = NixlEndpoint("decode", [kv_rows])        # receiver
    prefill = NixlEndpoint("prefill", [kv_rows_src])  # sender
    peer = prefill.connect(decode.metadata())         # metadata passed out of band
    h = prefill.write_rows(peer, [(0, 3, 7)], b"req-1")
    prefill.wait(h)                                   # or poll(h) in a loop
    decode.wait_notification(b"req-1")               # data has landed when this returns

Metadata exchange is not NIXL's job; ``send_metadata``/``recv_metadata`` pass it
through a multiprocessing Pipe or Queue, ``write_metadata_file``/
``read_metadata_file`` through a file.

Tested with nixl 1.5.1 (bundled UCX 1.23.0) on CPU, DRAM buffers.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
_POLL_SLEEP_S = 0.001
_METADATA_VERSION = 1

# Environment defaults for UCX, applied only where the user has set nothing.
# UCX_NET_DEVICES=lo keeps the rig's network traffic (NIXL's control and
# notification messages, and the data itself for DRAM) on loopback, so a run
# never depends on, or sprays onto, the host's real NICs. It leaves shared
# memory and CUDA transports (cuda_ipc, cuda_copy) alone: those are not
# network devices. Do not narrow UCX_TLS to shared memory only ("sm,self"):
# NIXL's UCX backend asks for peer-failure handling, which only tcp (or RDMA)
# provides, and backend creation then fails with NIXL_ERR_BACKEND.
# UCX_MODULES=^ib: no InfiniBand modules on loopback. Where libibverbs is
# installed (Mooncake's wheel needs it, docs/rig.md), UCX otherwise loads them,
# and an agent whose peer died crashed at process exit (SIGSEGV, NIXL 1.5.1's
# UCX 1.23; tests/builtin_rig/test_transport.py's dead-peer tests).
UCX_LOOPBACK_DEFAULTS = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}


class TransportError(RuntimeError):
    """A NIXL call failed; the message names the call and the NIXL status."""


class PeerError(TransportError):
    """The peer is unknown, unreachable, or went away."""


class TransportTimeout(TransportError, TimeoutError):
    """Something awaited did not happen within its deadline."""


def apply_ucx_defaults(defaults: dict[str, str] | None = None) -> dict[str, str]:
    """Set UCX variables the user left unset; return those set.

    Must run before the first NIXL agent of the process is created, because
    UCX reads its configuration when the backend starts.
    """
    applied = {}
    for key, value in (UCX_LOOPBACK_DEFAULTS if defaults is None else defaults).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


@dataclass(frozen=True)
class BufferInfo:
    """Where one registered buffer lives, enough for a peer to address its rows."""

    addr: int
    row_bytes: int
    rows: int
    device: int  # CUDA ordinal for VRAM, 0 for DRAM (NIXL's convention)

    def row_addr(self, row: int) -> int:
        """Address of a row; callers have checked the index."""
        return self.addr + row * self.row_bytes


@dataclass
class PeerInfo:
    """What a connected peer told us about itself."""

    name: str
    mem_type: str
    buffers: list[BufferInfo]


@dataclass
class WriteHandle:
    """One posted WRITE; poll() moves ``state`` to DONE or ERR."""

    peer: str
    rows: int
    bytes_per_row: int
    notif: bytes
    state: str = "PROC"
    error: str | None = None
    _xfer: Any = None


def _is_torch_tensor(obj: object) -> bool:
    """True for a torch tensor, without importing torch for numpy users."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def describe_buffer(buf: Any, index: int) -> tuple[BufferInfo, str]:
    """Return (BufferInfo, "DRAM"|"VRAM") for a 2-D contiguous array or tensor.

    Rows must be contiguous because each row is sent as one address range.
    """
    if _is_torch_tensor(buf):
        if buf.dim() != 2 or not buf.is_contiguous():
            raise ValueError(f"buffer {index}: need a 2-D contiguous tensor, got shape {tuple(buf.shape)}")
        rows, row_bytes = buf.shape[0], buf.shape[1] * buf.element_size()
        mem = "VRAM" if buf.is_cuda else "DRAM"
        device = buf.device.index if buf.is_cuda else 0
        addr = buf.data_ptr()
    elif hasattr(buf, "__array_interface__") and hasattr(buf, "ctypes"):
        if buf.ndim != 2 or not buf.flags["C_CONTIGUOUS"]:
            raise ValueError(f"buffer {index}: need a 2-D C-contiguous array, got shape {buf.shape}")
        if not buf.flags["WRITEABLE"]:
            raise ValueError(f"buffer {index}: array is read-only, a peer could not write into it")
        rows, row_bytes = buf.shape[0], buf.shape[1] * buf.itemsize
        mem, device, addr = "DRAM", 0, buf.ctypes.data
    else:
        raise TypeError(f"buffer {index}: expected a numpy array or torch tensor, got {type(buf).__name__}")
    if rows == 0 or row_bytes == 0:
        raise ValueError(f"buffer {index}: empty buffer (rows={rows}, row_bytes={row_bytes})")
    return BufferInfo(int(addr), int(row_bytes), int(rows), int(device)), mem


def _nixl_failure(what: str, exc: BaseException) -> str:
    """One line naming the failed call and NIXL's status (e.g. NIXL_ERR_NOT_FOUND)."""
    return f"{what} failed: {type(exc).__name__}: {exc}"


def _error_class(exc: BaseException) -> type[TransportError]:
    """PeerError when NIXL says the peer went away, TransportError otherwise."""
    return PeerError if "Disconnect" in type(exc).__name__ else TransportError


def _check_row(kind: str, row: int, buf: BufferInfo, index: int, side: str) -> None:
    """Raise a ValueError naming the side, buffer and row when a row is out of range."""
    if not 0 <= row < buf.rows:
        raise ValueError(f"{kind} row {row} out of range for {side} buffer {index} ({buf.rows} rows)")


class NixlEndpoint:
    """One NIXL agent with UCX and a fixed set of registered row buffers.

    Buffers are 2-D: a page is a row. All buffers of one endpoint must be DRAM,
    or all VRAM, because a NIXL descriptor list carries a single memory type.
    The endpoint keeps references to them so they outlive the registration.
    Use an endpoint from one thread; NIXL's own progress thread is internal.
    """

    def __init__(self, name: str, buffers: Sequence[Any], *, ucx_defaults: bool = True):
        if not name:
            raise ValueError("endpoint name must be a non-empty string")
        if not buffers:
            raise ValueError("endpoint needs at least one buffer to register")
        described = [describe_buffer(b, i) for i, b in enumerate(buffers)]
        mem_types = {mem for _, mem in described}
        if len(mem_types) != 1:
            raise ValueError(f"buffers mix memory types {sorted(mem_types)}; use one endpoint per type")
        if ucx_defaults:
            apply_ucx_defaults()
        self.name = name
        self.mem_type = mem_types.pop()
        self.buffers = [info for info, _ in described]
        self._arrays = list(buffers)
        self._peers: dict[str, PeerInfo] = {}
        self._pending_notifs: list[tuple[str, bytes]] = []
        self._open_handles: list[WriteHandle] = []
        self._agent = self._create_agent(name)
        self._reg = self._register()

    def _create_agent(self, name: str) -> Any:
        """Start a NIXL agent with only the UCX backend and a progress thread.

        The progress thread lets peers' WRITEs complete while this process is
        busy elsewhere: over tcp, UCX emulates RMA with messages that the
        target must progress.
        """
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransportError(f"cannot import nixl ({exc}); install the 'nixl' package") from exc
        try:
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        except Exception as exc:
            raise TransportError(_nixl_failure(f"creating NIXL agent {name!r} with UCX", exc)) from exc
        if "UCX" not in agent.backends:
            raise TransportError(f"NIXL agent {name!r} has no UCX backend (plugins: {agent.get_plugin_list()})")
        return agent

    def _register(self) -> Any:
        """Register every buffer with NIXL in one call."""
        regions = [(b.addr, b.rows * b.row_bytes, b.device, "") for b in self.buffers]
        try:
            return self._agent.register_memory(regions, self.mem_type, backends=["UCX"])
        except Exception as exc:
            raise TransportError(_nixl_failure(f"registering {len(regions)} {self.mem_type} buffers", exc)) from exc

    def _require_open(self) -> None:
        """Refuse calls after close(): the agent is gone."""
        if self._agent is None:
            raise TransportError(f"endpoint {self.name!r} is closed")

    # -- metadata and peers -------------------------------------------------

    def metadata(self) -> bytes:
        """Serialise agent metadata plus row geometry, for the peer's connect()."""
        self._require_open()
        blob = {
            "version": _METADATA_VERSION,
            "name": self.name,
            "mem_type": self.mem_type,
            "buffers": [vars(b) for b in self.buffers],
            "agent_md": base64.b64encode(self._agent.get_agent_metadata()).decode("ascii"),
        }
        return json.dumps(blob).encode("utf-8")

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata (NIXL connects to it here); return its name.

        Connecting again to a name already known replaces the old entry, so a
        restarted peer can be picked up.
        """
        self._require_open()
        peer = parse_metadata(peer_metadata)
        if peer.name == self.name:
            raise ValueError(f"peer metadata carries this endpoint's own name {self.name!r}")
        if peer.name in self._peers:
            self.disconnect(peer.name)
        try:
            loaded = self._agent.add_remote_agent(peer.agent_md)
        except Exception as exc:
            raise PeerError(
                _nixl_failure(f"connecting to peer {peer.name!r}", exc) + " (is the peer process alive?)"
            ) from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != peer.name:
            raise PeerError(f"NIXL metadata names agent {loaded!r} but the blob says {peer.name!r}")
        self._peers[peer.name] = PeerInfo(peer.name, peer.mem_type, peer.buffers)
        return peer.name

    def disconnect(self, peer: str) -> None:
        """Forget a peer and drop NIXL's connection to it."""
        self._require_open()
        if self._peers.pop(peer, None) is None:
            raise PeerError(f"not connected to peer {peer!r}")
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:
            raise PeerError(_nixl_failure(f"disconnecting from peer {peer!r}", exc)) from exc

    def peers(self) -> list[str]:
        """Names of connected peers."""
        return list(self._peers)

    # -- sending ------------------------------------------------------------

    def write_rows(
        self,
        peer: str,
        pairs: Sequence[tuple[int, int, int]],
        notif: bytes,
        byte_limit_per_row: int | None = None,
    ) -> WriteHandle:
        """Post one NIXL WRITE of local rows into a peer's rows, with a notification.

        ``pairs`` holds (buffer_index, src_row, dst_row): local row src_row of
        buffer buffer_index goes to the peer's row dst_row of the same buffer
        index. ``byte_limit_per_row`` writes only the first K bytes of each
        row (fault injection "partial_write"). ``notif`` reaches the peer once
        all rows have landed; b"" sends none.
        """
        self._require_open()
        info = self._peer(peer)
        notif = notif.encode() if isinstance(notif, str) else bytes(notif)
        pairs = list(pairs)
        if not pairs:
            raise ValueError("write_rows needs at least one (buffer_index, src_row, dst_row) pair")
        local, remote, nbytes = self._descriptors(info, pairs, byte_limit_per_row)
        try:
            local_d = self._agent.get_xfer_descs(local, self.mem_type)
            remote_d = self._agent.get_xfer_descs(remote, info.mem_type)
            xfer = self._agent.initialize_xfer("WRITE", local_d, remote_d, peer, notif)
        except Exception as exc:
            hint = " (rows lie outside registered memory)" if "NotFound" in type(exc).__name__ else ""
            raise _error_class(exc)(
                _nixl_failure(f"preparing WRITE of {len(pairs)} rows to {peer!r}", exc) + hint
            ) from exc
        handle = WriteHandle(peer, len(pairs), nbytes, notif, _xfer=xfer)
        self._open_handles.append(handle)
        self._post(handle)
        return handle

    def _peer(self, peer: str) -> PeerInfo:
        """Look up a connected peer or say it is not connected."""
        try:
            return self._peers[peer]
        except KeyError:
            known = ", ".join(self._peers) or "none"
            raise PeerError(f"not connected to peer {peer!r} (connected: {known}); call connect() first") from None

    def _descriptors(
        self, info: PeerInfo, pairs: list[tuple[int, int, int]], limit: int | None
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], int]:
        """Check every pair and build (addr, len, dev) lists for both sides."""
        local, remote, nbytes = [], [], None
        for pair in pairs:
            if len(pair) != 3:
                raise ValueError(f"pair {pair!r} is not (buffer_index, src_row, dst_row)")
            b, src, dst = (int(x) for x in pair)
            if not 0 <= b < len(self.buffers) or b >= len(info.buffers):
                raise ValueError(
                    f"buffer index {b} out of range (local has {len(self.buffers)}, "
                    f"peer {info.name!r} has {len(info.buffers)})"
                )
            mine, theirs = self.buffers[b], info.buffers[b]
            if mine.row_bytes != theirs.row_bytes:
                raise ValueError(f"buffer {b}: local rows are {mine.row_bytes} bytes, peer's {theirs.row_bytes}")
            _check_row("src", src, mine, b, "local")
            _check_row("dst", dst, theirs, b, f"peer {info.name!r}")
            nbytes = self._row_len(mine.row_bytes, limit, b)
            local.append((mine.row_addr(src), nbytes, mine.device))
            remote.append((theirs.row_addr(dst), nbytes, theirs.device))
        return local, remote, nbytes

    @staticmethod
    def _row_len(row_bytes: int, limit: int | None, index: int) -> int:
        """Bytes to send per row: the whole row, or the first ``limit`` bytes."""
        if limit is None:
            return row_bytes
        if not 0 < int(limit) <= row_bytes:
            raise ValueError(f"byte_limit_per_row={limit} must be in 1..{row_bytes} (buffer {index} row size)")
        return int(limit)

    def _post(self, handle: WriteHandle) -> None:
        """Post the prepared WRITE; a dead peer shows up here as a PeerError."""
        try:
            state = self._agent.transfer(handle._xfer)
        except Exception as exc:
            self._finish(handle, "ERR", _nixl_failure(f"posting WRITE to {handle.peer!r}", exc))
            raise _error_class(exc)(handle.error) from exc
        if state == "ERR":
            self._finish(handle, "ERR", f"posting WRITE to {handle.peer!r} returned ERR")
            raise TransportError(handle.error)
        if state == "DONE":
            self._finish(handle, "DONE")

    def poll(self, handle: WriteHandle) -> str:
        """Return 'DONE', 'PROC' or 'ERR' for a posted WRITE, without blocking."""
        if handle.state != "PROC":
            return handle.state
        self._require_open()
        try:
            state = self._agent.check_xfer_state(handle._xfer)
        except Exception as exc:
            self._finish(handle, "ERR", _nixl_failure(f"checking WRITE to {handle.peer!r}", exc))
            return "ERR"
        if state == "ERR":
            self._finish(handle, "ERR", f"WRITE to {handle.peer!r} ended in ERR")
        elif state == "DONE":
            self._finish(handle, "DONE")
        return handle.state

    def wait(self, handle: WriteHandle, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until the WRITE is DONE; raise on ERR or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.poll(handle) == "PROC":
            if time.monotonic() > deadline:
                raise TransportTimeout(f"WRITE of {handle.rows} rows to {handle.peer!r} not done after {timeout}s")
            time.sleep(_POLL_SLEEP_S)
        if handle.state == "ERR":
            cls = PeerError if "Disconnect" in (handle.error or "") else TransportError
            raise cls(handle.error or f"WRITE to {handle.peer!r} failed")

    def _finish(self, handle: WriteHandle, state: str, error: str | None = None) -> None:
        """Record the final state and give NIXL its request back."""
        handle.state, handle.error = state, error
        self._release(handle)

    def _release(self, handle: WriteHandle) -> None:
        """Release the NIXL request; NIXL refuses to free one still in flight."""
        if handle._xfer is None:
            return
        try:
            handle._xfer.release()
        except Exception:
            return  # still in flight; nixl_agent frees leaked handles at teardown
        handle._xfer = None
        if handle in self._open_handles:
            self._open_handles.remove(handle)

    # -- receiving ----------------------------------------------------------

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Return and forget every notification received so far, as (peer, message).

        NIXL never pushes notifications: they queue inside the agent until
        asked for, so a receiver must call this (or wait_notification).
        """
        self._require_open()
        self._collect()
        out, self._pending_notifs = self._pending_notifs, []
        return out

    def wait_notification(
        self, notif: bytes | None = None, peer: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> tuple[str, bytes]:
        """Wait for a matching notification and return it as (peer, message).

        ``notif``/``peer`` of None match anything. Others stay queued for later
        calls. Raises TransportTimeout after ``timeout`` seconds.
        """
        self._require_open()
        deadline = time.monotonic() + timeout
        while True:
            self._collect()
            for i, (who, msg) in enumerate(self._pending_notifs):
                if (notif is None or msg == notif) and (peer is None or who == peer):
                    return self._pending_notifs.pop(i)
            if time.monotonic() > deadline:
                want = f"{notif!r}" if notif is not None else "any notification"
                raise TransportTimeout(f"{self.name!r}: no {want} from {peer or 'any peer'} after {timeout}s")
            time.sleep(_POLL_SLEEP_S)

    def _collect(self) -> None:
        """Move NIXL's queued notifications into our own ordered list."""
        try:
            fresh = self._agent.get_new_notifs()
        except Exception as exc:
            raise TransportError(_nixl_failure("reading notifications", exc)) from exc
        for who, msgs in fresh.items():
            who = who.decode() if isinstance(who, bytes) else who
            self._pending_notifs.extend((who, bytes(m)) for m in msgs)

    # -- teardown -----------------------------------------------------------

    def close(self) -> None:
        """Release requests, registrations, peers and the agent; safe to call twice."""
        if self._agent is None:
            return
        for handle in list(self._open_handles):
            self._release(handle)
        for peer in list(self._peers):
            try:
                self.disconnect(peer)
            except TransportError:
                pass  # the peer may be gone already; the agent goes next anyway
        try:
            self._agent.deregister_memory(self._reg, backends=["UCX"])
        except Exception:
            pass  # the agent's destructor frees what is left
        self._agent, self._reg, self._arrays = None, None, []

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ParsedMetadata:
    """A peer's metadata blob, decoded."""

    name: str
    mem_type: str
    buffers: list[BufferInfo]
    agent_md: bytes


def parse_metadata(blob: bytes) -> ParsedMetadata:
    """Decode NixlEndpoint.metadata() output, with errors that say what is wrong."""
    try:
        doc = json.loads(bytes(blob).decode("utf-8"))
        if doc.get("version") != _METADATA_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {_METADATA_VERSION}")
        buffers = [BufferInfo(**b) for b in doc["buffers"]]
        return ParsedMetadata(doc["name"], doc["mem_type"], buffers, base64.b64decode(doc["agent_md"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a transport metadata blob: {exc}") from exc


# -- metadata exchange between processes -------------------------------------


def send_metadata(channel: Any, blob: bytes) -> None:
    """Send a metadata blob through a multiprocessing Connection or Queue."""
    if hasattr(channel, "send_bytes"):
        channel.send(bytes(blob))
    elif hasattr(channel, "put"):
        channel.put(blob)
    else:
        raise TypeError(f"cannot send through {type(channel).__name__}; need a Pipe end or a Queue")


def recv_metadata(channel: Any, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
    """Receive a metadata blob from a Connection or Queue, or raise TransportTimeout."""
    if hasattr(channel, "recv_bytes"):
        if not channel.poll(timeout):
            raise TransportTimeout(f"no peer metadata on the pipe after {timeout}s")
        blob = channel.recv()
    elif hasattr(channel, "get"):
        try:
            blob = channel.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no peer metadata on the queue after {timeout}s") from None
    else:
        raise TypeError(f"cannot receive from {type(channel).__name__}; need a Pipe end or a Queue")
    if not isinstance(blob, bytes):
        raise TransportError(f"expected peer metadata bytes, got {type(blob).__name__}: {blob!r:.200}")
    return blob


def write_metadata_file(path: str | os.PathLike, blob: bytes) -> None:
    """Write a metadata blob so a reader never sees it half-written (rename is atomic)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def read_metadata_file(path: str | os.PathLike, timeout: float = DEFAULT_TIMEOUT_S) -> bytes:
    """Wait for a metadata file to appear and return its bytes, or raise TransportTimeout."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TransportTimeout(f"metadata file {os.fspath(path)!r} did not appear within {timeout}s")
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()
