"""The fleet engine's native line pass (`offline/fleet/cscan.c`, docs/fleet.md): its xxh64
against the `xxhash` package, its canonical split against the pure-Python path's (DuckDB's
ingest) line by line, and its file-level decisions (checksum, torn tail, odd lines, chunk
boundaries) against the reference join's findings."""

from __future__ import annotations

import random

import pytest
import xxhash
from tests.offline.test_fleet_equivalence import assert_same, hostile_set, raw_line, write
from tests.support.logdata import Fault, RoomPlan, room_records

from dsv4_idxk_probe.offline import fleet
from dsv4_idxk_probe.offline.fleet import scan as fleet_scan
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.reader import expand_inputs

pytest.importorskip("duckdb")
native = fleet.native


def test_the_native_module_is_built():
    """`pip install -e .` builds it wherever a C compiler is (the fallback is for the rest)."""
    assert native.cscan is not None, "the extension dsv4_idxk_probe.offline.fleet.cscan was not built"


def cscan():
    if native.cscan is None:
        pytest.fail("the native line pass is not built")
    return native.cscan


def test_xxh64_matches_xxhash_on_random_inputs():
    rng = random.Random(34)
    lengths = list(range(0, 130)) + [rng.randrange(130, 5000) for _ in range(3000)] + [1 << 20, (1 << 20) + 13]
    for n in lengths:
        data = rng.randbytes(n)
        assert cscan().xxh64(data) == xxhash.xxh64_intdigest(data), n
    # unaligned views of one buffer
    blob = rng.randbytes(4096)
    for start in range(0, 40):
        view = memoryview(blob)[start:start + 1000 + start]
        assert cscan().xxh64(view) == xxhash.xxh64_intdigest(view), start


# %% the canonical split, line by line, against the pure-Python path


def _body(line: bytes) -> bytes:
    return line[: line.rindex(b',"h":')]


def _mutations() -> dict[str, tuple[str, bytes]]:
    """name -> (side, line): one changed line each, the checksum made valid again."""
    pre, dec = room_records(RoomPlan(3, steps=(40,)))
    p, d = encode_line(pre[0]), encode_line(dec[1])

    def sub(line: bytes, old: bytes, new: bytes) -> bytes:
        assert old in line, old
        return raw_line(_body(line).replace(old, new, 1) + b"}")

    cases = {"prefill as written": ("p", p), "decode as written": ("d", d)}
    for side, line in (("p", p), ("d", d)):
        cases.update({
            f"{side}: ts exponent": (side, sub(line, b'"ts":', b'"ts":1e9,"zz":')),
            f"{side}: ts negative": (side, raw_line(_ts(line, b"-5.5"))),
            f"{side}: ts long": (side, raw_line(_ts(line, repr(1733212345.1234567).encode()))),
            f"{side}: ts too many digits": (side, raw_line(_ts(line, b"1733212345.123456789"))),
            f"{side}: ts 17 digits not shortest": (side, raw_line(_ts(line, b"1733212345.1234568"))),
            f"{side}: ts trailing zero": (side, raw_line(_ts(line, b"1733212345.50"))),
            f"{side}: ts N.00": (side, raw_line(_ts(line, b"1733212345.00"))),
            f"{side}: ts small": (side, raw_line(_ts(line, b"0.00001"))),
            f"{side}: ts int": (side, raw_line(_ts(line, b"1733212345"))),
            f"{side}: ts null": (side, raw_line(_ts(line, b"null"))),
            f"{side}: ts 12 digits": (side, raw_line(_ts(line, b"173321234500.5"))),
            f"{side}: v 2": (side, sub(line, b'"v":1', b'"v":2')),
            f"{side}: kind": (side, sub(line, b'"kind":"room"', b'"kind":"roam"')),
            f"{side}: stage unknown": (side, sub(line, b'"stage":"', b'"stage":"x')),
            f"{side}: room empty": (side, sub(line, b'"room":"3"', b'"room":""')),
            f"{side}: room long": (side, sub(line, b'"room":"3"', b'"room":"' + b"3" * 257 + b'"')),
            f"{side}: room 256": (side, sub(line, b'"room":"3"', b'"room":"' + b"3" * 256 + b'"')),
            f"{side}: room number": (side, sub(line, b'"room":"3"', b'"room":3')),
            f"{side}: attempt 01": (side, sub(line, b'"attempt":0', b'"attempt":01')),
            f"{side}: attempt big": (side, sub(line, b'"attempt":0', b'"attempt":1234567890123456789')),
            f"{side}: attempt negative": (side, sub(line, b'"attempt":0', b'"attempt":-1')),
            f"{side}: role number": (side, sub(line, b'"role":"', b'"role":1,"x":"')),
            f"{side}: instance escaped": (side, sub(line, b'"instance":"', b'"instance":"\\"')),
            f"{side}: instance null": (side, sub(line, b'"instance":"', b'"instance":null,"zz":"')),
            f"{side}: layout null": (side, _set(line, b"layout", b"null")),
            f"{side}: digest array": (side, _digest(line, b"[1]")),
            f"{side}: digest string": (side, _digest(line, b'"x"')),
            f"{side}: digest null": (side, _digest(line, b"null")),
            f"{side}: digest empty object": (side, _digest(line, b"{}")),
            f"{side}: digest with a space": (side, sub(line, b'"signature":', b'"signature": ')),
            f"{side}: digest escaped key": (side, sub(line, b'"key":"', b'"key":"\\u0033')),
            f"{side}: digest NaN": (side, sub(line, b'"n_tokens":', b'"n_tokens":NaN,"x":')),
            f"{side}: digest trailing comma": (side, sub(line, b'"pages":[', b'"pages":[1,],"p":[')),
            f"{side}: digest uppercase hex": (side, _upper_page(line)),
            f"{side}: digest n_tokens 13 digits": (side, sub(line, b'"n_tokens":', b'"n_tokens":1000000000000,"x":')),
            f"{side}: digest n_tokens float": (side, sub(line, b'"n_tokens":600', b'"n_tokens":600.0')),
            f"{side}: digest layer id 01": (side, sub(line, b'"layer_ids":[0', b'"layer_ids":[00')),
            f"{side}: digest row missing": (side, sub(line, b'"layer_segment":[[', b'"layer_segment":[[],[')),
            f"{side}: digest a row fewer": (side, _drop_row(line)),
            f"{side}: digest deep": (side, sub(line, b'"pages":[', b'"deep":' + b"[" * 100 + b"]" * 100
                                               + b',"pages":[')),
            f"{side}: verdict unknown": (side, _set(line, b"verdict", b'"great"')),
            f"{side}: verdict mismatch": (side, _set(line, b"verdict", b'"mismatch"')),
            f"{side}: reason escaped": (side, sub(line, b'"reason":""', b'"reason":"a\\nb"')),
            f"{side}: reason UTF-8": (side, sub(line, b'"reason":""', '"reason":"é"'.encode())),
            f"{side}: expected_room int": (side, sub(line, b'"expected_room":null', b'"expected_room":3')),
            f"{side}: localisation set": (side, sub(line, b'"localisation":null', b'"localisation":{}')),
            f"{side}: tokens": (side, sub(line, b',"rid":', b',"tokens":512,"rid":')),
            f"{side}: tokens 13 digits": (side, sub(line, b',"rid":', b',"tokens":1000000000000,"rid":')),
            f"{side}: tokens null": (side, sub(line, b',"rid":', b',"tokens":null,"rid":')),
            f"{side}: rid": (side, _set(line, b"rid", b'"req-7"')),
            f"{side}: rid empty": (side, _set(line, b"rid", b'""')),
            f"{side}: extra key": (side, raw_line(_body(line) + b',"cluster":"a"}')),
            f"{side}: key twice": (side, raw_line(_body(line) + b',"rid":null}')),
            f"{side}: no rid": (side, raw_line(_body(line)[: _body(line).rindex(b',"rid":')] + b"}")),
            f"{side}: a space before the checksum": (side, raw_line(_body(line) + b" }")),
        })
    return cases


def _ts(line: bytes, value: bytes) -> bytes:
    body = _body(line)
    start = body.index(b'"ts":') + 5
    return body[:start] + value + body[body.index(b",", start):] + b"}"


def _set(line: bytes, key: bytes, value: bytes) -> bytes:
    body = _body(line)
    start = body.index(b',"' + key + b'":') + len(key) + 4
    end = body.index(b',"', start) if body.find(b',"', start) >= 0 else len(body)
    return raw_line(body[:start] + value + body[end:] + b"}")


def _digest(line: bytes, value: bytes) -> bytes:
    body = _body(line)
    start = body.index(b',"digest":') + len(b',"digest":')
    end = body.index(b',"verdict":')
    return raw_line(body[:start] + value + body[end:] + b"}")


def _drop_row(line: bytes) -> bytes:
    """The digest's first layer_segment row removed: one row fewer than layer ids."""
    body = _body(line)
    start = body.index(b'"layer_segment":[') + len(b'"layer_segment":[')
    end = body.index(b"],", start) + 2
    return raw_line(body[:start] + body[end:] + b"}")


def _upper_page(line: bytes) -> bytes:
    body = _body(line)
    start = body.index(b'"pages":["') + len(b'"pages":["')
    return raw_line(body[:start] + body[start:start + 16].upper() + body[start + 16:] + b"}")


def _tables(inputs, monkeypatch, path: str) -> tuple[dict, set, set]:
    """{ord: rec row without dh}, the set of odd (fid, line), and the fast files' fids."""
    monkeypatch.setenv(fleet.table_route.ENV, "0")  # the rows as the DuckDB route holds them
    if path == "python":
        monkeypatch.setenv(native.ENV, "0")
    else:
        monkeypatch.delenv(native.ENV, raising=False)
    analysis = fleet.analyse_fleet(expand_inputs(map(str, inputs)))
    try:
        con = analysis.con
        rows = {r[1]: r for r in con.execute(
            "SELECT fid, ord, room, attempt, stage, step, ts, live, rid, tokens, dvalid, instance, cells, layout, dh "
            "FROM rec").fetchall()}
        odd = set(con.execute("SELECT fid, line FROM odd").fetchall())
        fast = {r[0] for r in con.execute("SELECT fid FROM files").fetchall()}
    finally:
        analysis.close()
    return rows, odd, fast


def _compare_passes(inputs, monkeypatch) -> tuple[dict, dict]:
    """Both passes over the same files: the native one refuses every line the Python one
    refuses, reads every line both accept alike, and hashes digests alike up to naming."""
    cscan()
    nat, nat_odd, nat_fast = _tables(inputs, monkeypatch, "native")
    py, py_odd, py_fast = _tables(inputs, monkeypatch, "python")
    assert py_fast <= nat_fast
    accepted_only_natively = {o for o, r in nat.items() if r[0] in py_fast and o not in py}
    assert accepted_only_natively == set(), "the native pass accepted a line the Python pass refuses"
    for o, r in nat.items():
        if o in py:
            if r[10] is False:  # a prefill digest pack_digest refuses: its key is complex, its tokens and cells unread
                assert py[o][10] is False, o
                r, py[o] = r[:9] + r[10:12] + r[13:], py[o][:9] + py[o][10:12] + py[o][13:]
            assert r[:-1] == py[o][:-1], o
    # digests hashed by another function: the same partition of the rows that have one
    pairs = {(r[-1], py[o][-1]) for o, r in nat.items() if o in py and r[-1] is not None}
    assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})
    assert {x for x in py_odd if x[0] in nat_fast} <= nat_odd
    return nat, py


def test_the_native_split_refuses_every_line_the_python_pass_refuses(tmp_path, monkeypatch):
    cases = _mutations()
    # one file per side, every case a line of it, among clean records of other rooms
    pre_lines, dec_lines, names = [], [], {}
    for i in range(1, 4):
        p, d = room_records(RoomPlan(10 + i))
        pre_lines += [encode_line(r) for r in p]
        dec_lines += [encode_line(r) for r in d]
    for name, (side, line) in cases.items():
        target = pre_lines if side == "p" else dec_lines
        target.append(line)
        names[(side, len(target))] = name
    inputs = [write(tmp_path / "p" / "prefill-a-1.000001.jsonl", pre_lines),
              write(tmp_path / "d" / "decode-a-2.000001.jsonl", dec_lines)]
    nat, py = _compare_passes(inputs, monkeypatch)
    lines = {o & ((1 << 40) - 1) for o in nat}
    # the cases the writer's format allows stay on the fast path in both
    writer_spellings = {"as written", "ts int", "ts null", "ts long", "tokens", "rid", "room 256", "digest null",
                        "verdict mismatch", "layout null"}
    for (side, line), name in names.items():
        if name.split(" ", 1)[-1].split(": ")[-1] in writer_spellings:
            assert ((0 if side == "p" else 1) << 40 | line) in nat, name
    assert len(lines) > 20


def test_the_native_split_on_the_hostile_lines(tmp_path, monkeypatch):
    _compare_passes(hostile_set(tmp_path / "logs"), monkeypatch)


def _digest_text(line: bytes) -> bytes:
    body = _body(line)
    return body[body.index(b',"digest":') + len(b',"digest":'):body.index(b',"verdict":')]


def test_a_lines_row_does_not_depend_on_the_lines_before_it():
    """Each line scanned alone, in a chunk of its own, gives the row it gives in its file: a
    digest whose bytes are the line before's is compared with them instead of read again, and
    a line is split before its newline is looked for; neither may change a row."""
    pre, dec = room_records(RoomPlan(5, steps=(32, 64)))
    p, d = [encode_line(r) for r in pre], [encode_line(r) for r in dec]
    assert _digest_text(p[0]) == _digest_text(d[0])  # one digest text for the whole room
    refused = _drop_row(d[1])  # a digest pack_digest refuses
    lines = d + p  # a prefill record after decode records with its very digest: still checked as prefill's
    lines += [refused] * 3 + [_digest(p[0], _digest_text(refused))]  # the refused one as prefill's
    lines += [_digest(d[2], _digest_text(d[2]) + b" ")]  # the same digest, then a space: odd
    lines += [d[3], _set(d[3], b"verdict", b'"mismatch"'), _digest(d[3], b"null"), d[3]]
    lines += [_digest(d[1], b'{"a":[1,{"b":"c"}]}')] * 2  # another object, repeated
    lines += [d[0][:-1]]  # the last line without its newline
    data = b"".join(lines)
    whole = cscan().scan_chunk(data, 1, True)
    assert whole[0] == 0 and whole[2] == len(lines)
    cols, odd = {k: [] for k in whole[5]}, []
    for i, line in enumerate(lines, start=1):
        status, _, n_lines, n_valid, _, part, part_odd = cscan().scan_chunk(line, i, True)
        assert (status, n_lines, n_valid) == (0, 1, 1), i
        for k, v in part.items():
            cols[k].append(v)
        odd.append(part_odd)
    assert b"".join(odd) == whole[6] and len(whole[6]) == 8  # the line with a space after its digest
    for k, v in whole[5].items():
        assert (b"".join(cols[k]) if isinstance(v, bytes) else sum(cols[k], [])) == v, k
    flags = whole[5]["flags"]
    assert flags[len(d)] == 3 and flags[len(d) + len(p) + 3] == 1  # prefill's digest as written, refused


def test_ts_reads_as_python_reads_it_when_spelled_as_the_writer_spells_it():
    """A ts is canonical as an integer or as repr(float) spells it (what orjson writes), and
    then reads as Python reads it; any other spelling is an odd line."""
    rng = random.Random(7)
    values = ["0", "0.5", "1.0", "1.50", "2.00", "0.0001", "0.00001", "1733212345", "99999999999.99999999999999999999"]
    values += [f"{rng.randrange(1, 10 ** 11)}.{rng.randrange(0, 10 ** rng.randrange(1, 21))}" for _ in range(300)]
    values += [repr(rng.uniform(0, 2e9)) for _ in range(300)] + [repr(rng.uniform(0, 1)) for _ in range(100)]
    values = [v for v in values if "e" not in v]
    pre, _ = room_records(RoomPlan(1))
    line = encode_line(pre[0])
    data = b"".join(raw_line(_ts(line, v.encode())) for v in values)
    status, _, n, _, _, cols, odd = cscan().scan_chunk(data, 1, True)
    assert (status, n) == (0, len(values))
    import numpy as np

    spelled = [i + 1 for i, v in enumerate(values) if "." not in v or repr(float(v)) == v]
    assert 300 < len(spelled) < len(values)
    assert np.frombuffer(cols["line"], np.int64).tolist() == spelled
    assert sorted(np.frombuffer(odd, np.int64).tolist() + spelled) == list(range(1, len(values) + 1))
    got = np.frombuffer(cols["ts"], np.float64).tolist()
    assert got == [float(values[i - 1]) for i in spelled]


# %% whole files: checksums, torn tails, chunk boundaries


def _bad_files(root):
    pre, dec = [], []
    for i in range(1, 9):
        p, d = room_records(RoomPlan(i, fault=Fault(1, 1, 3) if i == 5 else None))
        pre += [encode_line(r) for r in p]
        dec += [encode_line(r) for r in d]
    edited = bytearray(dec[4])
    edited[40] ^= 1
    write(root / "p" / "prefill-a-1.000001.jsonl", pre)
    write(root / "d" / "decode-a-2.000001.jsonl", dec[:10])
    write(root / "d" / "decode-a-3.000001.jsonl", dec[10:20] + [bytes(edited)] + dec[20:22])  # a bad checksum
    write(root / "d" / "decode-a-4.000001.jsonl", dec[22:] + [dec[0][:300]])  # torn last line
    write(root / "d" / "decode-a-5.000001.jsonl", [dec[1][:-1]])  # a whole line without newline
    write(root / "d" / "decode-a-6.000001.jsonl", [dec[2].replace(b'"reason":""', b'"reason":"x"')])  # not a checksum
    return [root / "p", root / "d"]


@pytest.mark.parametrize("chunk", [None, 700, 3000])
def test_bad_checksum_torn_tail_and_odd_lines_give_the_reference_findings(tmp_path, capsys, monkeypatch, chunk):
    cscan()
    monkeypatch.delenv(native.ENV, raising=False)
    if chunk:
        monkeypatch.setattr(fleet_scan, "CHUNK_BYTES", chunk)  # the chunks both passes read (`line_chunks`)
    inputs = _bad_files(tmp_path / "logs")
    report = assert_same(capsys, tmp_path, *inputs)
    assert report["summary"]["bad_lines"] >= 2
    analysis = fleet.analyse_fleet(expand_inputs(map(str, inputs)))
    try:
        assert analysis.stats.slow_files == 2  # the bad checksum, the line that is not torn
        assert analysis.stats.fast_files == 4
    finally:
        analysis.close()


def test_without_the_module_diff_says_so_and_takes_the_python_pass(tmp_path, capsys, monkeypatch):
    """An install that could not build the extension: the same findings, by the pure-Python
    pass, and `diff` says which pass it took."""
    monkeypatch.delenv(native.ENV, raising=False)
    inputs = _bad_files(tmp_path / "logs")
    monkeypatch.setattr(native, "cscan", None)
    assert_same(capsys, tmp_path, *inputs)
    from dsv4_idxk_probe.cli.main import run

    run(["diff", *map(str, inputs), "--engine", "duckdb"])
    err = capsys.readouterr().err
    assert "line pass: pure Python + DuckDB (the native module was not built)" in err
    monkeypatch.undo()
    if native.cscan is not None:
        run(["diff", *map(str, inputs), "--engine", "duckdb"])
        assert "line pass: native (cscan)" in capsys.readouterr().err
