"""Peer authentication of the exchange: a shared secret, HMAC-SHA256 both ways.

Prefill and decode run in different pods, so both read the same secret (a
Kubernetes Secret mounted as a file, `exchange.secret_file`). A connection
starts with a challenge in each direction, then every frame carries a tag
keyed by that session, so a peer without the secret is refused after reading
at most `CLIENT_HELLO` bytes, and a frame cannot be replayed or altered::

    server -> client   MAGIC (4) + server nonce (16)
    client -> server   client nonce (16) + HMAC(secret, "client" + nonces) (32)
    server -> client   HMAC(secret, "server" + nonces) (32)
    then, each way:    length (4, big-endian) + payload + HMAC(session, dir + seq + payload)[:16]

A server that turns a connection away for load before its handshake is done
sends `BUSY` (4 bytes, in place of its greeting or its proof) and closes; a
refused secret is a close with nothing, so the client can tell "busy" from
"secret" (docs/security.md).

With no secret configured the key is empty: the handshake and tags still run
(they then only catch torn or foreign traffic), and the server refuses to
listen beyond loopback (`address.check_bind`). Nothing is encrypted: digests
are folds of hashes, not cache contents (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct

from ..boundedfile import read_bounded

MAGIC = b"DXK1"
BUSY = b"DXKB"  # "closed for load, ask again later", then the server closes (never a whole greeting or proof)
NONCE = 16
MAC = 32
TAG = 16
SERVER_HELLO = len(MAGIC) + NONCE
CLIENT_HELLO = NONCE + MAC
HEADER = struct.Struct(">I")
MAX_SECRET_FILE_BYTES = 4096
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """A secret file that cannot be used; the message names it."""


_warned: set = set()  # (path, mode) already logged: the config, the server and the client each load it


def secret_mode_problem(mode: int) -> tuple[bool, str] | None:
    """(refused, why) for a secret file's permission bits; None when only its owner may use it.

    Writable by every user: refused (anyone on the host could swap the key).
    Readable or writable by its group or others: allowed, with a warning.
    """
    bits = stat.S_IMODE(mode)
    if bits & stat.S_IWOTH:
        return True, f"is writable by every user (mode {bits:04o}): anyone on the host could replace it; chmod 600 it"
    if bits & (stat.S_IRWXG | stat.S_IRWXO):
        return False, (f"is readable by users other than its owner (mode {bits:04o}); chmod 600 it "
                       "(Kubernetes: defaultMode: 0400 on the Secret volume)")
    return None


def secret_file_warning(path: str | os.PathLike) -> str | None:
    """The warning `load_secret` logs for this file, or None (for `check`)."""
    try:
        problem = secret_mode_problem(os.stat(path).st_mode)
    except OSError:
        return None
    return f"{path}: the exchange secret {problem[1]}" if problem and not problem[0] else None


def load_secret(path: str | os.PathLike) -> bytes:
    """The secret in a file (surrounding whitespace dropped): a regular file, read with a size cap,
    refused if every user may write it, logged at WARNING if others may read it."""

    def inspect(info: os.stat_result) -> None:
        problem = secret_mode_problem(info.st_mode)
        if problem is None:
            return
        refused, why = problem
        if refused:
            raise SecretError(f"{path}: the exchange secret {why}")
        key = (str(path), stat.S_IMODE(info.st_mode))
        if key not in _warned:
            _warned.add(key)
            logging.getLogger("dsv4_idxk_probe.exchange").warning("dsv4-idxk-probe: %s: the exchange secret %s",
                                                                   path, why)

    data = read_bounded(path, "exchange secret", MAX_SECRET_FILE_BYTES, SecretError, inspect).strip()
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"{path}: the exchange secret must be at least {MIN_SECRET_BYTES} bytes, got {len(data)}")
    return data


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def server_hello(nonce_s: bytes) -> bytes:
    return MAGIC + nonce_s


def client_proof(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return nonce_c + _mac(secret, b"dsv4-idxk/client", nonce_s, nonce_c)


def server_proof(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return _mac(secret, b"dsv4-idxk/server", nonce_s, nonce_c)


def session_key(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return _mac(secret, b"dsv4-idxk/session", nonce_s, nonce_c)


def check_client(secret: bytes, nonce_s: bytes, hello: bytes) -> bytes | None:
    """The client's nonce when its proof holds, else None (constant-time compare)."""
    nonce_c, proof = hello[:NONCE], hello[NONCE:CLIENT_HELLO]
    expected = _mac(secret, b"dsv4-idxk/client", nonce_s, nonce_c)
    return nonce_c if hmac.compare_digest(proof, expected) else None


class FrameMac:
    """Tags and checks the frames of one session, one sequence number per direction."""

    def __init__(self, key: bytes, send_dir: bytes, recv_dir: bytes):
        self.key = key
        self.send_dir, self.recv_dir = send_dir, recv_dir
        self.sent = self.received = 0

    def seal(self, payload: bytes) -> bytes:
        tag = _mac(self.key, self.send_dir, struct.pack(">Q", self.sent), payload)[:TAG]
        self.sent += 1
        return HEADER.pack(len(payload)) + payload + tag

    def open(self, payload: bytes, tag: bytes) -> bool:
        expected = _mac(self.key, self.recv_dir, struct.pack(">Q", self.received), payload)[:TAG]
        self.received += 1
        return hmac.compare_digest(tag, expected)


def new_nonce() -> bytes:
    return os.urandom(NONCE)
