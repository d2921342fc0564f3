"""Messages of the vector exchange: one JSON object per frame (docs/security.md).

Request:  {"v": 1, "id": <int>, "key": "<room>/<attempt>"}
Response: {"v": 1, "id": <int>, "found": true, "digest": <RoomDigest.to_record()>}
          {"v": 1, "id": <int>, "found": false}
          {"v": 1, "id": <int>, "error": "<why>"}

Both sides decode with msgspec against a fixed schema: a value of the wrong
type is refused where it starts (``[[[[...`` where an object belongs never
nests), unknown fields are refused before they are parsed, strings, lists and
integers have upper bounds, so decoding is bounded in time, depth and memory
by the frame size. Every failure is an `ExchangeError`.
"""

from __future__ import annotations

from typing import Annotated, Optional

import msgspec
import numpy as np

from ..digest.result import RoomDigest

VERSION = 1
MAX_KEY_CHARS = 64
MAX_LAYERS = 1024
MAX_SEGMENTS = 64
MAX_PAGES = 1 << 22  # 4M pages of 64 tokens: far beyond any context length
MAX_ID = (1 << 63) - 1

_Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]
_Id = Annotated[int, msgspec.Meta(ge=-1, le=MAX_ID)]
_Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_CHARS)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ExchangeError(ValueError):
    """A malformed request or response; the message says which field."""


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    id: _Id
    key: _Key


class _Digest(msgspec.Struct, forbid_unknown_fields=True):
    key: _Key
    signature: _Hex64
    n_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    layer_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]], msgspec.Meta(max_length=MAX_LAYERS)]
    segments: Annotated[list[_Name], msgspec.Meta(min_length=1, max_length=MAX_SEGMENTS)]
    layer_segment: Annotated[
        list[Annotated[list[_Hex64], msgspec.Meta(max_length=MAX_SEGMENTS)]], msgspec.Meta(max_length=MAX_LAYERS)
    ]
    pages: Annotated[list[_Hex64], msgspec.Meta(max_length=MAX_PAGES)]
    room: Optional[_Hex64] = None


class _Response(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    id: _Id
    found: bool = False
    digest: Optional[_Digest] = None
    error: Optional[Annotated[str, msgspec.Meta(max_length=512)]] = None


_request_decoder = msgspec.json.Decoder(_Request)
_response_decoder = msgspec.json.Decoder(_Response)
_encoder = msgspec.json.Encoder()


def _decode(decoder: msgspec.json.Decoder, frame: bytes, what: str):
    try:
        message = decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ExchangeError(f"{what} does not follow the schema: {exc}") from None
    except (msgspec.DecodeError, RecursionError, MemoryError, OverflowError) as exc:
        raise ExchangeError(f"{what} is not JSON: {exc}") from None
    if message.v != VERSION:
        raise ExchangeError(f"{what} must have v={VERSION}, got {message.v}")
    return message


def encode_request(request_id: int, key: str) -> bytes:
    return _encoder.encode({"v": VERSION, "id": int(request_id), "key": str(key)})


def decode_request(frame: bytes, max_bytes: int) -> tuple[int, str]:
    """(id, key) of a request frame; ExchangeError when it is too big or malformed."""
    if len(frame) > max_bytes:
        raise ExchangeError(f"request of {len(frame)} bytes exceeds max_request_bytes={max_bytes}")
    message = _decode(_request_decoder, frame, "request")
    return message.id, message.key


def encode_response(request_id: int, digest: RoomDigest | None = None, error: str | None = None) -> bytes:
    message: dict = {"v": VERSION, "id": int(request_id)}
    if error is not None:
        message["error"] = str(error)[:512]
    else:
        message["found"] = digest is not None
        if digest is not None:
            message["digest"] = digest.to_record()
    return _encoder.encode(message)


def decode_response(frame: bytes) -> tuple[int, RoomDigest | None]:
    """(id, digest or None when the peer does not hold the room); ExchangeError otherwise."""
    message = _decode(_response_decoder, frame, "response")
    if message.error is not None:
        raise ExchangeError(f"peer refused the request: {message.error}")
    if not message.found or message.digest is None:
        return message.id, None
    return message.id, _digest(message.digest)


def _digest(d: _Digest) -> RoomDigest:
    """Shapes are checked before anything is allocated from them; values are 64-bit by the schema."""
    if len(d.layer_segment) != len(d.layer_ids) or any(len(row) != len(d.segments) for row in d.layer_segment):
        raise ExchangeError(
            f"response.digest.layer_segment must be {len(d.layer_ids)} rows of {len(d.segments)} values"
        )
    cells = bytes.fromhex("".join(v for row in d.layer_segment for v in row))
    digest = RoomDigest(
        key=d.key,
        signature=int(d.signature, 16),
        n_tokens=d.n_tokens,
        layer_ids=tuple(d.layer_ids),
        segments=tuple(d.segments),
        layer_segment=np.frombuffer(cells, dtype=">u8").astype(np.uint64).reshape(len(d.layer_ids), len(d.segments)),
        pages=np.frombuffer(bytes.fromhex("".join(d.pages)), dtype=">u8").astype(np.uint64),
    )
    if d.room is not None and int(d.room, 16) != digest.room:
        raise ExchangeError("response.digest.room does not equal the fold of its layer_segment matrix")
    return digest
