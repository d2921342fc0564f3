"""Random bytes and random JSON values into every parser that meets outside input:
the exchange decoders, the room-log reader and analysis, the config
and fault-spec loaders. Each must give a valid result or its own named error,
never another exception. Moderate example counts: CI runs this on 2 cores."""

from __future__ import annotations

import json
import math
import string

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_idxk_probe.config import ConfigError, load_file, parse_config
from dsv4_idxk_probe.exchange.protocol import ExchangeError, decode_request, decode_response
from dsv4_idxk_probe.offline.join import _Joiner, analyse
from dsv4_idxk_probe.offline.results import Analysis
from dsv4_idxk_probe.offline.validation import RecordError
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.lineformat import LineError, decode_line
from dsv4_idxk_probe.roomlog.reader import read_file
from dsv4_idxk_probe.testbed.faults.spec import FaultSpecError, parse_fault_spec

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])

keys = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
                           max_leaves=30)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# %% exchange


@FUZZ
@given(st.binary(max_size=600) | st.builds(nested, st.integers(1, 5000)))
def test_exchange_decoders_on_random_bytes(frame):
    for decode in (lambda f: decode_request(f, 4096), decode_response):
        try:
            decode(frame)
        except ExchangeError:
            pass


@FUZZ
@given(st.dictionaries(st.sampled_from(["v", "id", "key", "found", "digest", "error", "x"]), json_values, max_size=6))
def test_exchange_decoders_on_random_json_objects(message):
    frame = json.dumps(message).encode()
    for decode in (lambda f: decode_request(f, 1 << 20), decode_response):
        try:
            decode(frame)
        except ExchangeError:
            pass


DIGEST_KEYS = ["key", "signature", "n_tokens", "layer_ids", "segments", "layer_segment", "pages", "room"]


@FUZZ
@given(st.dictionaries(st.sampled_from(DIGEST_KEYS), json_values, max_size=8))
def test_exchange_response_digests_of_random_shape(digest):
    frame = json.dumps({"v": 1, "id": 1, "found": True, "digest": digest}).encode()
    try:
        _, got = decode_response(frame)
    except ExchangeError:
        return
    assert got.layer_segment.shape == (len(got.layer_ids), len(got.segments))


# %% room logs


ROOM_KEYS = ["v", "kind", "room", "attempt", "stage", "step", "verdict", "digest", "ts", "pool", "branch",
             "direction", "count"]


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(ROOM_KEYS), json_values, min_size=1, max_size=10), max_size=6))
def test_analysis_on_checksummed_records_of_random_fields(records):
    analysis = Analysis()
    joiner = _Joiner(analysis)
    for i, record in enumerate(records):
        try:
            line = encode_line(record)
        except (TypeError, ValueError):
            continue  # the writer would drop it
        try:
            joiner.add_record(decode_line(line), "f", i)
        except RecordError:
            pass
    joiner.finish()
    analysis.summary()


@FUZZ
@given(st.binary(max_size=2000))
def test_room_log_reader_on_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "x.jsonl"
    path.write_bytes(data)
    for entry in read_file(path, max_line=512):
        assert (entry.record is None) != (entry.error is None)
    analyse([path]).summary()


@FUZZ
@given(st.binary(max_size=300))
def test_line_decoder_on_random_bytes(data):
    try:
        assert isinstance(decode_line(data), dict)
    except LineError:
        pass


# %% config and fault specs


CONFIG_KEYS = ["mode", "layout", "step_interval", "targets", "exchange", "roomlog", "metrics", "digest", "x"]


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS) | st.integers(0, 3), json_values, max_size=6))
def test_config_parser_on_random_documents(document):
    try:
        parse_config(document, "fuzz.yaml")
    except ConfigError:
        pass


@FUZZ
@given(st.binary(max_size=600))
def test_config_loader_on_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cfg") / "probe.yaml"
    path.write_bytes(data)
    try:
        load_file(path)
    except ConfigError:
        pass


FAULT_KEYS = ["name", "room", "when", "where", "kind", "bit", "value", "keep_bytes", "with_room", "x"]


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(FAULT_KEYS), json_values, max_size=6), max_size=3))
def test_fault_spec_parser_on_random_faults(faults):
    try:
        parse_fault_spec(yaml.safe_dump({"faults": faults}))
    except FaultSpecError:
        pass


@FUZZ
@given(st.text(max_size=300))
def test_fault_spec_parser_on_random_text(text):
    try:
        parse_fault_spec(text)
    except FaultSpecError:
        pass


# %% reliability round two: anchors and aliases, numbers past every bound


def _loaders():
    from dsv4_idxk_probe.sglang.targets import TargetFileError, parse_target_table

    def config(text):
        from pathlib import Path
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "probe.yaml"
            path.write_text(text)
            load_file(path)

    return [(config, ConfigError), (parse_fault_spec, FaultSpecError),
            (lambda text: parse_target_table(text, "t.yaml"), TargetFileError)]


@FUZZ
@given(json_values, st.sampled_from(["targets", "faults", "mode", "hicache"]), st.integers(1, 9))
def test_every_yaml_loader_refuses_anchors_and_aliases(value, key, uses):
    flow = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()
    text = f"{key}: [&v {flow}" + ", *v" * uses + "]\n"
    for load, error in _loaders():
        try:
            load(text)
        except error as exc:
            assert "anchors and aliases are not accepted" in str(exc), str(exc)
        else:
            raise AssertionError(f"{text!r} was accepted")


NUMERIC_FIELDS = [("exchange", k) for k in ("port_base", "timeout_ms", "table_size", "max_request_bytes", "backoff_s",
                                            "backoff_initial_s", "retry_s", "max_connections", "idle_s")] + [
    ("roomlog", k) for k in ("max_bytes", "max_files", "queue_size")] + [("metrics", "port")] + [
    ("diagnosis", k) for k in ("journal_events", "journal_per_page", "index_cells", "max_cells_per_room")] + [
    (None, "step_interval")]
huge = st.integers(-(10**6000), 10**6000) | st.integers(-(2**80), 2**80) | st.floats()


@FUZZ
@given(st.sampled_from(NUMERIC_FIELDS), huge)
def test_config_numbers_are_in_range_or_a_config_error(field, value):
    section, key = field
    try:
        config = parse_config({key: value} if section is None else {section: {key: value}}, "fuzz.yaml")
    except ConfigError as exc:
        assert len(str(exc)) < 300
        return
    got = getattr(config, key) if section is None else getattr(getattr(config, section), key)
    assert got is not None and math.isfinite(got) and 0 <= got <= 1 << 36


@FUZZ
@given(st.sampled_from(["guard_stack_logs", "flush_interval_s", "index_queue_max", "roundtrip_max_entries"]), huge)
def test_hicache_numbers_are_in_their_range_or_an_error(key, value):
    from dsv4_idxk_probe.hicache.settings import RANGES, HiCacheConfigError, parse_settings

    try:
        settings = parse_settings({key: value})
    except HiCacheConfigError as exc:
        assert len(str(exc)) < 300
        return
    low, high = RANGES[key]
    assert low <= getattr(settings, key) <= high
