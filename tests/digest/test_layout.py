"""Layouts: shipped geometry, user additions, and errors that name the field."""

import pytest

from dsv4_idxk_probe.digest import LayoutError, get_layout, layout_signature, load_layouts, shipped_layouts
from dsv4_idxk_probe.digest.layout import parse_layout


@pytest.mark.parametrize(
    "name, row_bytes, scale_offset",
    [("fp8", 8448, 8192), ("fp4", 4352, 4096), ("bf16", 16384, None)],
)
def test_shipped_geometry_matches_sglang(name, row_bytes, scale_offset):
    layout = get_layout(name)
    assert layout.row_bytes == row_bytes
    assert layout.page_tokens == 256
    offsets = {s.name: s.offset for s in layout.segments}
    assert offsets.get("scale") == scale_offset


def test_user_layout_file_adds_a_layout(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "layouts:\n  padded:\n    slots: 32\n    tokens_per_slot: 4\n    row_bytes: 4352\n"
        "    segments:\n      - {name: k, slot_bytes: 128}\n      - {name: s, slot_bytes: 4, offset: 4224}\n"
    )
    layout = get_layout("padded", load_layouts(path))
    assert layout.row_bytes == 4352
    assert [s.offset for s in layout.segments] == [0, 4224]
    assert layout.page_tokens == 128


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"slots": 64, "tokens_per_slot": 4}, "layouts.x.segments is missing"),
        ({"slots": "64", "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 4}]}, "layouts.x.slots"),
        ({"slots": 64, "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 6}]}, "segments[0].slot_bytes"),
        ({"slots": 64, "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 4, "offset": 2}]}, "segments[0].offset"),
        (
            {"slots": 2, "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 8}, {"name": "q", "slot_bytes": 4, "offset": 8}]},
            "segments[1].offset 8 overlaps",
        ),
        ({"slots": 2, "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 4}, {"name": "p", "slot_bytes": 4}]}, "used twice"),
        ({"slots": 2, "tokens_per_slot": 4, "row_bytes": 4, "segments": [{"name": "p", "slot_bytes": 4}]}, "row_bytes 4 is smaller"),
        ({"slots": 2, "tokens_per_slot": 4, "colour": 1, "segments": [{"name": "p", "slot_bytes": 4}]}, "unknown field(s) ['colour']"),
        # keys of other YAML types beside a string (a TypeError in sorting them, found by review)
        ({"slots": 2, "tokens_per_slot": 4, 1: "a", "b": 2, "segments": [{"name": "p", "slot_bytes": 4}]},
         "unknown field(s) ['b', 1]"),
        ({"slots": 2, "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 4, None: 1, "b": 2}]},
         "segments[0] has unknown field(s) ['b', None]"),
        ({"slots": 0, "tokens_per_slot": 4, "segments": [{"name": "p", "slot_bytes": 4}]}, "layouts.x.slots must be >= 1"),
        # `diff` refuses longer segment names: every record of the layout was a bad line to it
        ({"slots": 2, "tokens_per_slot": 4, "segments": [{"name": "p" * 257, "slot_bytes": 4}]},
         "segments[0].name must be a non-empty string of at most 256 characters"),
    ],
)
def test_malformed_layout_names_the_field(spec, field):
    with pytest.raises(LayoutError) as err:
        parse_layout("x", spec, "f.yaml")
    assert field in str(err.value)
    assert str(err.value).startswith("f.yaml: ")


def test_bad_yaml_and_missing_file_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("layouts: [unclosed\n")
    with pytest.raises(LayoutError, match="bad.yaml: not valid YAML"):
        load_layouts(bad)
    with pytest.raises(LayoutError, match="nope.yaml: cannot read"):
        load_layouts(tmp_path / "nope.yaml")
    with pytest.raises(LayoutError, match="unknown layout 'fp2'"):
        get_layout("fp2")


def test_signature_separates_what_must_agree():
    fp8, fp4 = get_layout("fp8"), get_layout("fp4")
    base = layout_signature(fp8, [0, 2])
    assert base == layout_signature(shipped_layouts()["fp8"], [0, 2])
    assert len({base, layout_signature(fp4, [0, 2]), layout_signature(fp8, [0, 3]), layout_signature(fp8, [2, 0])}) == 4


def test_a_layouts_file_with_an_alias_bomb_is_refused_at_once(tmp_path):
    bomb = tmp_path / "layouts.yaml"
    rows = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                                                    for p, c in zip("abcdefgh", "bcdefghi")]
    bomb.write_text("\n".join(rows) + "\n")
    with pytest.raises(LayoutError, match="layouts.yaml"):
        load_layouts(bomb)


def test_a_layouts_file_too_big_is_refused(tmp_path):
    big = tmp_path / "layouts.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(LayoutError, match="layouts file"):
        load_layouts(big)
