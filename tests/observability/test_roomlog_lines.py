"""The per-line checksum: every edit, truncation or torn write is caught."""

from __future__ import annotations

import json

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_idxk_probe.roomlog.lineformat import LineError, decode_line, encode_line

RECORD = {"v": 1, "kind": "room", "room": "17", "attempt": 0, "stage": "decode_recv", "digest": None, "ts": 1.5}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
records = st.dictionaries(st.text(max_size=10).filter(lambda k: k != "h"), json_values, min_size=1, max_size=6)


@given(records)
@settings(max_examples=200, deadline=None)
def test_any_plain_record_round_trips(record):
    line = encode_line(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_line(line) == record


def test_checksum_is_xxh64_of_the_bytes_before_the_checksum_member():
    """The documented definition, checked from the bytes alone (docs/roomlog.md)."""
    line = encode_line(RECORD).rstrip(b"\n")
    head, _, tail = line.rpartition(b',"h":"')
    assert tail[-2:] == b'"}' and xxhash.xxh64_hexdigest(head) == tail[:-2].decode()
    assert json.loads(line)["h"] == xxhash.xxh64_hexdigest(head)


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_every_single_byte_change_is_detected(data):
    line = encode_line(RECORD)
    pos = data.draw(st.integers(0, len(line) - 2))  # the newline itself is not content
    new = data.draw(st.integers(0, 255).filter(lambda b: b != line[pos]))
    edited = line[:pos] + bytes([new]) + line[pos + 1 :]
    if edited.rstrip(b"\r\n") == line.rstrip(b"\r\n"):
        return  # turned the last content byte into a line ending: not an edit of the content
    with pytest.raises(LineError):
        decode_line(edited)


@pytest.mark.parametrize("cut", [1, 2, 10, 30, 60])
def test_torn_lines_are_detected(cut):
    line = encode_line(RECORD)
    with pytest.raises(LineError):
        decode_line(line[: len(line) - 1 - cut])


def test_reencoded_json_is_rejected_even_when_equivalent():
    """A tool that rewrites the line (other spacing, other key order) invalidates it."""
    pretty = json.dumps(json.loads(encode_line(RECORD)), indent=1).replace("\n", "").encode()
    with pytest.raises(LineError):
        decode_line(pretty)


@pytest.mark.parametrize("bad", [{}, {"h": 1, "v": 1}, [1, 2], {"x": object()}, {"x": 2**70 + 1},
                                 {"x": "\ud800", "y": float("nan")}])
def test_unwritable_records_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        encode_line(bad)


@pytest.mark.parametrize("text", ["plain", "caf\u00e9 \u4e2d", "lone \ud800 surrogate", "\x00 control"])
def test_any_text_round_trips_whichever_encoder_writes_it(text):
    """UTF-8 from orjson, escapes from the standard library (lone surrogates): both read back."""
    record = {"v": 1, "reason": text, "extra": {"big": 2**64 - 1, "small": -(2**63), "ok": [1.5, None]}}
    assert decode_line(encode_line(record)) == record


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_written_as_null_and_never_read_back_as_numbers(value):
    """Records hold no NaN by construction; if one slips in, the line stays valid JSON."""
    line = encode_line({"x": {"y": ["a", value]}})
    assert decode_line(line) == {"x": {"y": ["a", None]}}


def test_a_line_holding_nan_literals_is_refused_by_the_reader():
    head = b'{"v":NaN'
    line = head + b',"h":"' + xxhash.xxh64_hexdigest(head).encode() + b'"}\n'
    with pytest.raises(LineError):
        decode_line(line)
