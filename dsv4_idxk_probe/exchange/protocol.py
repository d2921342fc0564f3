"""Wire format of the vector exchange: one JSON object per ZMQ frame.

Request:  {"v": 1, "id": <int>, "key": "<room>/<attempt>"}
Response: {"v": 1, "id": <int>, "found": true, "digest": <RoomDigest.to_record()>}
          {"v": 1, "id": <int>, "found": false}
          {"v": 1, "id": <int>, "error": "<why>"}
"""

from __future__ import annotations

import json
from typing import Any

from ..digest.result import RoomDigest

VERSION = 1
MAX_KEY_CHARS = 64


class ExchangeError(ValueError):
    """A malformed request or response; the message says which field."""


def encode_request(request_id: int, key: str) -> bytes:
    return json.dumps({"v": VERSION, "id": int(request_id), "key": str(key)}, separators=(",", ":")).encode()


def decode_request(frame: bytes, max_bytes: int) -> tuple[int, str]:
    """(id, key) of a request frame; ExchangeError when it is too big or malformed."""
    if len(frame) > max_bytes:
        raise ExchangeError(f"request of {len(frame)} bytes exceeds max_request_bytes={max_bytes}")
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExchangeError(f"request is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != VERSION:
        raise ExchangeError(f"request must be an object with v={VERSION}")
    request_id, key = message.get("id"), message.get("key")
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        raise ExchangeError("request.id must be an integer")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise ExchangeError(f"request.key must be a string of 1-{MAX_KEY_CHARS} characters")
    return request_id, key


def encode_response(request_id: int, digest: RoomDigest | None = None, error: str | None = None) -> bytes:
    message: dict[str, Any] = {"v": VERSION, "id": int(request_id)}
    if error is not None:
        message["error"] = error
    else:
        message["found"] = digest is not None
        if digest is not None:
            message["digest"] = digest.to_record()
    return json.dumps(message, separators=(",", ":")).encode()


def decode_response(frame: bytes) -> tuple[int, RoomDigest | None]:
    """(id, digest or None when the peer does not hold the room); ExchangeError otherwise."""
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExchangeError(f"response is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("v") != VERSION or not isinstance(message.get("id"), int):
        raise ExchangeError(f"response must be an object with v={VERSION} and an integer id")
    if "error" in message:
        raise ExchangeError(f"peer refused the request: {message['error']}")
    if not message.get("found"):
        return message["id"], None
    try:
        return message["id"], RoomDigest.from_record(message["digest"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExchangeError(f"response.digest is malformed: {exc!r}") from None
