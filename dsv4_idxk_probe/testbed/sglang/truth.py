"""The index-K bytes the stand-in model writes: a pure function of (layer, position, token).

The real model writes, for each C4 layer, one 132-byte slot (128 fp8 payload
bytes, one float32 scale) per four tokens, when the token at position
``4k + 3`` is processed. The stand-in writes `slot_bytes(layer, p, token_at_p)`
there. Any process that knows a request's token ids can therefore recompute
every slot of it (the byte oracle does, inside decode), and two requests with
the same tokens at the same positions get the same bytes, as a shared radix
prefix must. No SGLang import.
"""

from __future__ import annotations

import numpy as np

PAYLOAD = 128
SCALE = 4
SLOT = PAYLOAD + SCALE
TOKENS_PER_SLOT = 4

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 wraps by definition)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def slot_bytes(layer: int, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """uint8 [n, 132]: payload then a float32 scale in [1, 2), per (layer, position, token)."""
    positions = np.asarray(positions, dtype=np.uint64).reshape(-1)
    tokens = np.asarray(tokens, dtype=np.uint64).reshape(-1)
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(layer + 1) * _GOLDEN ^ (positions << np.uint64(20)) ^ tokens)
        words = _mix(key[:, None] + np.arange(1, 18, dtype=np.uint64)[None, :] * _GOLDEN)  # 17 x 8 = 136 B
    raw = words.view(np.uint8).reshape(len(positions), 136)
    out = np.empty((len(positions), SLOT), dtype=np.uint8)
    out[:, :PAYLOAD] = raw[:, :PAYLOAD]
    scale_bits = (raw[:, PAYLOAD : PAYLOAD + 4].copy().view(np.uint32).reshape(-1) & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)
    out[:, PAYLOAD:] = scale_bits.view(np.uint8).reshape(-1, 4)
    return out


def completing_positions(start: int, end: int) -> np.ndarray:
    """Positions in [start, end) whose token completes a C4 slot (p % 4 == 3)."""
    first = start + (3 - start % 4) % 4
    return np.arange(first, end, TOKENS_PER_SLOT, dtype=np.int64)


def next_token(token: int, vocab: int) -> int:
    """The stand-in's greedy choice after `token`: never 0 (bos) or 1 (eos)."""
    return (token * 7 + 3) % (vocab - 2) + 2
