"""The test vectors printed in docs/digest.md hold for the reference."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dsv4_idxk_probe.digest import get_layout
from dsv4_idxk_probe.digest import reference as ref

DOC = Path(__file__).resolve().parents[2] / "docs" / "digest.md"


def _vectors() -> dict:
    block = re.search(r"```json test-vectors\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/digest.md has no test-vectors block"
    return json.loads(block.group(1))


def _mod251_row(layout) -> np.ndarray:
    return (np.arange(layout.row_bytes) % 251).astype(np.uint8).reshape(1, -1)


def test_segment_digest_vectors():
    for v in _vectors()["segment_digests"]:
        layout = get_layout(v["layout"])
        got = ref.segment_digests(_mod251_row(layout), [v["frozen_slots"]], layout)[0]
        for seg, value in zip(layout.segments, got):
            assert f"{int(value):016x}" == v[seg.name], (v, seg.name)


def test_cell_vector():
    v = _vectors()["cell"]
    d = np.array([[int(v["d"], 16)]], dtype=np.uint64)
    c = ref.cell_contributions(d, [v["layer_id"]], [v["logical_page"]])
    assert v["segment"] == 1
    assert f"{int(c[0, 0]):016x}" == v["c"]


def test_room_vector():
    v = _vectors()["room"]
    layout = get_layout(v["layout"])
    buffers = [
        (np.arange(4 * layout.row_bytes).reshape(4, -1) * (l + 1) % 256).astype(np.uint8) for l in range(2)
    ]
    digest = ref.digest_room(buffers, v["physical_pages"], v["n_tokens"], layout, [1, 3])
    record = digest.to_record()
    for field in ("signature", "layer_segment", "pages", "room"):
        assert record[field] == v[field], field


@pytest.mark.parametrize("values", [[], [0], [1, 0xFFFFFFFFFFFFFFFF, 0x00000000000000AB], list(range(2**40, 2**40 + 61))])
def test_hex_words_are_16_digit_lowercase_per_value(values):
    from dsv4_idxk_probe.digest.result import _hex_rows, _hex_words

    array = np.array(values, dtype=np.uint64)
    assert _hex_words(array) == [f"{v:016x}" for v in values]
    if values:
        matrix = np.array(values * 2, dtype=np.uint64).reshape(2, len(values))
        assert _hex_rows(matrix) == [[f"{v:016x}" for v in values]] * 2


def test_zero_cell_content_vectors():
    for v in _vectors()["zero_cells"]:
        layout = get_layout(v["layout"])
        for s, seg in enumerate(layout.segments):
            assert f"{ref.zero_content_digest(layout, s, v['frozen_slots']):016x}" == v[seg.name], (v, seg.name)


def test_zero_cell_content_by_the_words_definition_written_out():
    """One zero-cell vector recomputed word by word with Python integers, apart from
    the reference's NumPy: docs/digest.md "Words" with w = 0."""
    v = next(v for v in _vectors()["zero_cells"] if v["layout"] == "fp4" and v["frozen_slots"] == 7)
    layout, m = get_layout("fp4"), 0xFFFFFFFF
    for seg in layout.segments:
        sum_a = sum_b = 0
        for j in range(seg.word_offset, seg.word_offset + 7 * seg.slot_words):
            x = (j * 0x9E3779B1 + 0x7F4A7C15) & m  # 0 XOR the position salt
            a = x ^ (x >> 16)  # fmix32
            a = (a * 0x85EBCA6B) & m
            a ^= a >> 13
            a = (a * 0xC2B2AE35) & m
            sum_a += a ^ (a >> 16)
            sum_b += ((x ^ (x >> 15)) * 0xC2B2AE35) & m
        assert f"{((sum_b & m) << 32) | (sum_a & m):016x}" == v[seg.name], seg.name


def test_room_contents_vector():
    v = _vectors()["room"]
    layout = get_layout(v["layout"])
    buffers = [
        (np.arange(4 * layout.row_bytes).reshape(4, -1) * (l + 1) % 256).astype(np.uint8) for l in range(2)
    ]
    contents = ref.room_contents(buffers, v["physical_pages"], v["n_tokens"], layout)
    assert [[[f"{int(x):016x}" for x in seg] for seg in page] for page in contents] == v["contents"]
