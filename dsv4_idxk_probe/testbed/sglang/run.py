"""Drive the SGLang rig: one server pair, any number of request phases, each judged.

A `RigSession` starts the pair (`launch.start`) with the probe switched on only
by ``DSV4_IDXK_PROBE`` and its config file, and the rig's plugin armed by a plan
file the session rewrites per phase (the in-server parts re-read it when it
changes). A phase sends its requests through the router, waits until decode has
taken every room's ``decode_finish`` digest, then judges the phase's rooms:

* every fault that changed frozen bytes is found at the first digest point
  whose oracle check shows those bytes changed, localised to its cells, and
  diagnosed as what the bytes became (docs/diagnosis.md): zeroed, another
  room's page (the swap partner), the page's previous occupant, or unknown;
* every mismatch the probe reports is explained by a fault;
* every probe verdict equals the oracle's, digest point by digest point;
* every request's output is the stand-in's deterministic continuation (the
  probe changes nothing SGLang returns).

The checks themselves are `testbed.faults.verify`'s, the same as the built-in rig's.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..faults.verify import Verification, verify
from . import launch, truth
from .env import ENV_OUT, ENV_PLAN
from .router_loss import lost_by_router
from .workload import Outcome, Request, send


#: What SGLang answers a request whose KV its checksum path (here: the probe's enforce) dropped.
ENFORCE_REFUSAL = "KV checksum mismatch"


@dataclass
class Phase:
    """What one phase sent and what came back, judged."""

    name: str
    requests: list[Request]
    outcomes: list[Outcome]
    rooms: dict[str, int]  # rid -> bootstrap room (from the oracle's records)
    verification: Verification | None = None
    faults: list[dict] = field(default_factory=list)  # what was injected, in testbed.faults.verify's form
    wrong_outputs: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    # planned faults of answered rooms that left no record, applied or not (a fault must never
    # vanish: the servers record each one applied, or not applied with the reason)
    unrecorded_faults: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # rids SGLang's router lost on one leg, each sent again as "<rid>-resent" (router_loss)
    router_lost: list[str] = field(default_factory=list)
    # rooms with fewer decode_step digests than the probe's step rule owes them (`missing_step_digests`)
    missing_step_digests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (bool(self.verification and self.verification.ok) and not self.wrong_outputs
                and not self.failed_requests and not self.unrecorded_faults and not self.missing_step_digests)


class RigSession:
    poll_s = 0.5  # how often a phase's settling looks at the servers' records

    def __init__(self, run_dir: Path, options: launch.ServerOptions | None = None, *, probe_config: str = "",
                 seed: int = 0, env: dict[str, str] | None = None, probe_mode: str = "1"):
        self.run_dir = Path(run_dir).resolve()
        self.options = options or launch.ServerOptions()
        self.seed = seed
        self.log_dir = self.run_dir / "logs"
        self.rig_out = self.run_dir / "rig"
        self.plan_path = self.run_dir / "rig-plan.json"
        self.config_path = self.run_dir / "probe.yaml"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # diagnosis on: the rig's faults have known diagnoses (docs/diagnosis.md). `probe_config`
        # may not name `roomlog` or `diagnosis` again: the config refuses a key given twice
        self.config_path.write_text(f"roomlog:\n  dir: {self.log_dir}\ndiagnosis:\n  enabled: true\n{probe_config}")
        self._write_plan({}, None)
        base = dict(os.environ if env is None else env)
        base.update({
            "DSV4_IDXK_PROBE": probe_mode, "DSV4_IDXK_PROBE_CONFIG": str(self.config_path),
            ENV_PLAN: str(self.plan_path), ENV_OUT: str(self.rig_out),
        })
        self.env = base
        self.cluster: launch.Cluster | None = None
        self.rooms: dict[str, int] = {}  # rid -> rig room number, over all phases
        self.started_s = 0.0

    # %% life cycle

    def start(self, timeout_s: float = 300.0) -> "RigSession":
        t0 = time.monotonic()
        self.cluster = launch.start(self.run_dir, self.options, self.env, timeout_s=timeout_s)
        self.started_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        if self.cluster is not None:
            time.sleep(1.0)  # the room-log writers flush behind the last records
            self.cluster.stop()
            self.cluster = None

    def __enter__(self) -> "RigSession":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # %% phases

    def _write_plan(self, rooms: dict[str, int], faults: str | None, **flags: Any) -> None:
        tmp = self.plan_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rooms": rooms, "seed": self.seed, "faults": faults, **flags}))
        os.replace(tmp, self.plan_path)

    def phase(self, name: str, requests: list[Request], *, faults: str | None = None, concurrency: int = 4,
              settle_s: float = 60.0, check_outputs: bool = True, scribble_freed: bool = False,
              fail_transfer: tuple[int, ...] = (), rejected: tuple[int, ...] = ()) -> Phase:
        """Send `requests` (their numbers are what `faults` names) and judge their rooms.

        The fault spec is checked against the model the servers run (its C4 layers, the
        index-K layout's segments and row) and against this phase's rooms before any
        request is sent: a bad spec raises `FaultSpecError` here, never inside SGLang.

        `scribble_freed`: decode zeroes each finished room's pages right after SGLang
        frees them (what a reused page's next writer does); nothing may be reported.
        `fail_transfer`: request numbers whose first KV transfer prefill fails on purpose at
        its last send (as its transfer worker does on a NIXL error): SGLang aborts that
        room; SGLang's router sends the request again, as a new room, and an answer to it
        is judged like any other (an error answer is not a failure of the phase).
        `rejected`: request numbers the probe's enforce mode must refuse (SGLang's answer to a
        KV checksum mismatch, HTTP 500): a failure of the phase if served, or refused otherwise.
        """
        assert self.cluster is not None, "start() the session first"
        spec = check_fault_spec(faults, requests, self.options) if faults else None
        t0 = time.monotonic()
        self.rooms.update({r.rid: r.number for r in requests})
        failing = {r.rid for r in requests if r.number in set(fail_transfer)}
        plan = {"faults": str(Path(faults).resolve()) if faults else None, "scribble_freed": scribble_freed,
                "fail_transfer": sorted(failing)}
        self._write_plan({r.rid: r.number for r in requests}, **plan)
        outcomes = send(self.cluster.url, requests, concurrency)
        requests, outcomes, router_lost = self._resend_router_lost(requests, outcomes, concurrency, plan)
        phase = Phase(name, requests, outcomes, {}, router_lost=router_lost)
        refused = {r.rid for r in requests if r.number in set(rejected)}
        for o in outcomes:
            if o.request.rid in refused:
                if o.status != 500 or ENFORCE_REFUSAL not in (o.error or ""):
                    phase.failed_requests.append(f"{o.request.rid}: HTTP {o.status} {o.error or ''}, not refused "
                                                 f"as enforce must ({ENFORCE_REFUSAL!r})")
            elif not o.request.aborted and o.status != 200 and o.request.rid not in failing:
                phase.failed_requests.append(f"{o.request.rid}: HTTP {o.status} {o.error}")
            elif check_outputs and o.status == 200 and o.output_ids != expected_output(o.request):
                phase.wrong_outputs.append(o.request.rid)
        completed = {o.request.rid for o in outcomes if o.status == 200}
        owed = planned_faults(spec, requests, self.seed, completed) if spec is not None else {}
        # a room enforce refused is judged too: its records are waited for like a served room's
        # (they were read before decode's writer had flushed them, and "not reported")
        judged = completed | {o.request.rid for o in outcomes if o.request.rid in refused and o.status == 500}
        self._settle(judged, settle_s, owed)  # settle_s: how long nothing may move
        phase.rooms = self._rooms_of({r.rid for r in requests})
        faults_seen = self._fault_records({r.rid for r in requests})
        oracle = self._oracle_records(set(phase.rooms.values()))
        planned = sorted(phase.rooms[rid] for rid in completed if rid in phase.rooms)
        missing = sorted(rid for rid in completed if rid not in phase.rooms)
        phase.failed_requests += [f"{rid}: decode never digested this room" for rid in missing]
        phase.unrecorded_faults = unrecorded(owed, faults_seen)
        phase.faults = expectations(faults_seen, oracle)
        phase.verification = verify(self.log_dir, phase.faults, oracle, planned, only_rooms=set(phase.rooms.values()))
        phase.missing_step_digests = missing_step_digests(outcomes, phase.rooms, oracle, self.step_interval())
        phase.seconds = time.monotonic() - t0
        return phase

    def step_interval(self) -> int:
        """The probe config's `step_interval` (0: no step digests)."""
        from ...config import load_file

        return int(load_file(self.config_path).step_interval)

    def _resend_router_lost(self, requests: list[Request], outcomes: list[Outcome], concurrency: int,
                            plan: dict[str, Any]) -> tuple[list[Request], list[Outcome], list[str]]:
        """Send once more, under a new rid, each request SGLang's router lost on one leg
        (`router_loss`); the phase judges the resent one in its place and names the lost rid.
        `plan`: the phase's `_write_plan` arguments besides its rooms."""
        logs = self.cluster.logs
        if "prefill" not in logs or "decode" not in logs:
            return requests, outcomes, []
        lost = [o for o in outcomes if lost_by_router(o, logs["prefill"], logs["decode"])]
        if not lost:
            return requests, outcomes, []
        again = {o.request.rid: replace(o.request, rid=f"{o.request.rid}-resent") for o in lost}
        requests = [again.get(r.rid, r) for r in requests]
        self.rooms.update({r.rid: r.number for r in again.values()})
        self._write_plan({r.rid: r.number for r in requests}, **plan)
        answered = {o.request.rid: o for o in send(self.cluster.url, list(again.values()), concurrency)}
        outcomes = [answered.get(again[o.request.rid].rid) if o.request.rid in again else o for o in outcomes]
        return requests, outcomes, sorted(again)

    def _settle(self, rids: set[str], stall_s: float, owed: dict | None = None) -> None:
        """Wait until decode digested every completed room at `decode_finish`, the logs caught
        up, and every fault `owed` to those rooms has its record (applied or not). A busy
        machine only slows this down: the wait goes on while anything still moves (rooms
        seen, digested, logged, faults recorded), and ends after `stall_s` without a change
        (a stall, which the phase's checks then report)."""
        last, moved = None, time.monotonic()
        while time.monotonic() - moved < stall_s:
            rooms = self._rooms_of(rids)
            finished = {o["room"] for o in self._read("oracle") if o.get("stage") == "decode_finish"}
            logged = self._logged(set(rooms.values()))
            missing = unrecorded(owed or {}, self._fault_records(set(rids)))
            if len(rooms) == len(rids) and set(rooms.values()) <= finished and logged and not missing:
                return
            progress = (len(rooms), len(set(rooms.values()) & finished), logged, len(missing))
            if progress != last:
                last, moved = progress, time.monotonic()
            time.sleep(self.poll_s)

    def _logged(self, rooms: set[int]) -> bool:
        from ...roomlog.reader import expand_inputs, read_entries

        finished, sent = set(), set()  # both sides' writers flush in the background
        try:
            for entry in read_entries(expand_inputs([str(self.log_dir)])):
                rec = entry.record
                if not isinstance(rec, dict) or rec.get("kind") != "room":
                    continue
                if rec.get("stage") == "decode_finish":
                    finished.add(int(rec.get("room")))
                elif rec.get("stage") == "prefill_send":
                    sent.add(int(rec.get("room")))
        except Exception:
            return False
        return rooms <= finished and rooms <= sent

    # %% in-server records

    def _read(self, kind: str) -> list[dict]:
        out = []
        for path in sorted(self.rig_out.glob(f"*-{kind}.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written right now
        return out

    def _rooms_of(self, rids: set[str]) -> dict[str, int]:
        return {o["rid"]: int(o["room"]) for o in self._read("oracle") if o.get("rid") in rids}

    def _oracle_records(self, rooms: set[int]) -> list[dict]:
        return [o for o in self._read("oracle") if o.get("room") in rooms and o.get("cells") is not None]

    def _fault_records(self, rids: set[str]) -> list[dict]:
        return [f for f in self._read("faults") if f.get("rid") in rids or f.get("partner_of") in rids]

    def events(self, rids: set[str]) -> list[dict]:
        """The in-server parts' other records (scribbled pages), for the phase's rooms."""
        return [e for e in self._read("events") if e.get("rid") in rids]

    def oracle(self, rids: set[str]) -> list[dict]:
        return [o for o in self._read("oracle") if o.get("rid") in rids]


def missing_step_digests(outcomes: list[Outcome], rooms: dict[str, int], oracle: list[dict],
                         interval: int) -> list[str]:
    """Rooms with fewer `decode_step` digests than the probe's rule owes them.
    The oracle reads bytes only where the probe digests, and a fault's expected stage is the
    first of those points that saw it: a probe that skipped its step digests, or took them
    more rarely than its rule, would move faults to later stages unnoticed. Its rule (a step
    digest of every running room on every `interval`-th decode batch; a room finishing in that
    batch gets its finish instead) owes a room decoded over B batches (its outputs less the one
    prefill gave) at least one where B >= 2 x interval and, sent once (no retraction), at least
    B // interval - 2, whatever the probe recorded (distinct (transfer, step) points: a V4.1
    pair's pool monitors report each point again)."""
    if interval <= 0:
        return []
    steps: dict = {}
    resent = {o.get("room") for o in oracle if o.get("transfer", 0)}
    for o in oracle:
        if o.get("stage") == "decode_step":
            steps.setdefault(o.get("room"), set()).add((o.get("transfer", 0), o.get("step")))
    missing = []
    for o in outcomes:
        if o.status != 200 or o.request.aborted or o.request.rid not in rooms:
            continue
        room, batches = rooms[o.request.rid], len(o.output_ids) - 1
        taken = len(steps.get(room, ()))
        # in one transfer, every interval-th batch steps the room: one off at each end (its
        # finish batch takes a finish digest instead, and where its batches start) at most
        owed = 1 if batches >= 2 * interval else 0
        if room not in resent:
            owed = max(owed, batches // interval - 2)
        if taken < owed:
            missing.append(f"{o.request.rid}: {len(o.output_ids)} outputs and {taken} decode_step digest(s), "
                           f"{owed} owed")
    return missing


def expected_output(request: Request) -> list[int]:
    """What greedy decoding of the stand-in returns: the next-token chain from the prompt's last token."""
    out, token = [], request.input_ids[-1]
    for _ in range(request.max_new_tokens):
        token = truth.next_token(token, launch.VOCAB)
        out.append(token)
    return out


def check_fault_spec(path: str | Path, requests: list[Request], options: launch.ServerOptions):
    """The spec at `path`, checked against the model the rig's servers run and the phase's
    rooms; `FaultSpecError` (file, field, what is wrong) otherwise. What it refuses would
    otherwise reach the servers as a fault that injects nothing: a layer that is not a C4
    layer, a segment or an offset the index-K row does not have, a room the phase does
    not send, `in_host_pool` on a pair without HiCache on prefill."""
    from ...digest import get_layout
    from ..faults.plan import RoomPlan
    from ..faults.spec import check_against, load_fault_spec

    spec = load_fault_spec(path)
    rooms = [RoomPlan(r.number, len(r.input_ids), 0, r.max_new_tokens) for r in requests]
    refusal = None if options.prefill_hicache else (
        "in_host_pool needs SGLang's HiCache on prefill: this server pair runs without it "
        "(ServerOptions(prefill_hicache=True))")
    check_against(spec, get_layout(launch.INDEX_K_LAYOUT), launch.c4_layer_ids(), rooms,
                  host_pool_refusal=refusal, scope="phase")
    return spec


def planned_faults(spec, requests: list[Request], seed: int, rids: set[str]) -> dict[tuple[int, str], Any]:
    """(fault index, rid) -> fault, for every fault the servers will apply to the rooms `rids`
    (drawn as the servers draw them: from the phase's room numbers and the seed)."""
    from ..faults.plan import RoomPlan

    numbers = sorted({r.number for r in requests})
    by_room = spec.by_room([RoomPlan(room=n, prompt_tokens=1, prefix_pages=0, steps=0) for n in numbers], seed)
    rid_of = {r.number: r.rid for r in requests}
    return {(f.index, rid_of[n]): f for n, faults in by_room.items() for f in faults if rid_of[n] in rids}


def unrecorded(owed: dict[tuple[int, str], Any], records: list[dict]) -> list[str]:
    """The faults `owed` (planned_faults) that no server record accounts for, as lines."""
    seen = {(f["fault"], f.get("rid")) for f in records if not f.get("partner_of")}
    return [f"{rid}: fault {fault.label} left no record (neither applied nor not applied)"
            for (index, rid), fault in sorted(owed.items(), key=lambda kv: (kv[0][1], kv[0][0]))
            if (index, rid) not in seen]


def _transfer_points(points: list[dict], n_tokens: int | None) -> list[dict]:
    """The oracle points of the room's transfer that held `n_tokens` tokens (a retracted room
    is sent again with its generated tokens added), in the order they were taken."""
    if n_tokens is not None:
        same = [o for o in points if o.get("n_tokens") == n_tokens]
        if same:
            return same
    return points


def expectations(fault_records: list[dict], oracle: list[dict]) -> list[dict]:
    """Fault records in `testbed.faults.verify`'s form: each changed cell's first stage is the first
    oracle point of the same transfer, at or after the fault, that sees the cell changed (None: no
    point does). A fault applied again to a room's later transfer (a retracted room, sent again)
    is a record of its own, expected at that transfer's points."""
    points: dict[int, list[dict]] = {}
    for o in oracle:
        points.setdefault(int(o["room"]), []).append(o)
    for ps in points.values():
        ps.sort(key=lambda o: (o.get("transfer", 0), o.get("index", 0)))
    merged: dict[tuple[int, Any, Any], dict] = {}
    for f in fault_records:
        room = f.get("room")
        owner = f.get("partner_of") or f.get("rid")
        owner_tokens = f.get("partner_of_tokens") if f.get("partner_of") else f.get("n_tokens")
        key = (f["fault"], owner, owner_tokens)
        record = merged.setdefault(key, {
            "fault": f["fault"], "name": f["name"], "kind": f["kind"], "when": f["when"],
            "after_step": f["after_step"], "side": f["side"], "room": room if not f.get("partner_of") else None,
            "rig_room": f.get("rig_room"), "applied": f["applied"], "reason": f.get("reason", ""),
            "target": f.get("target", {}), "transfer": f.get("transfer", 0), "effects": [],
        })
        if not f.get("partner_of"):
            record.update(room=room, rig_room=f.get("rig_room"), applied=f["applied"], reason=f.get("reason", ""),
                          transfer=f.get("transfer", 0))
        if f.get("roundtrip"):  # what HiCache round-trip mode must report (an in_host_pool fault)
            record["roundtrip"] = f["roundtrip"]
        # changed before prefill's digest (in the host pool, before the load): both sides digest
        # the changed bytes, so no digest point may report it; the oracle still sees it on decode
        upstream = f["when"] == "in_host_pool"
        expect = {(e[0], e[1], e[2]): e[3:] for e in f.get("expect", [])}
        for layer, page, segment in f.get("cells", []):
            room_points = _transfer_points(points.get(int(room), []), f.get("n_tokens")) if room is not None else []
            stage, step, tokens = _first_seen(room_points, f.get("point", 0), (layer, page, segment))
            effect = {"room": room, "layers": [layer], "page": page, "segments": [segment],
                      "stage": stage, "step": step, "tokens": tokens}
            if upstream:
                effect.update(stage=None, step=None, upstream=True, oracle_stage=stage)
            if (layer, page, segment) in expect:  # what the probe must say the cell became, and whose it is
                kind, culprit = expect[(layer, page, segment)]
                effect["diagnosis"] = {"kind": kind, "room": culprit}
            record["effects"].append(effect)
    return list(merged.values())


def _first_seen(points: list[dict], after: int, cell: tuple) -> tuple[str | None, int | None, int | None]:
    for o in points:
        if o.get("index", 0) >= after and list(cell) in o["cells"]:
            return o["stage"], o["step"], o.get("n_tokens")
    return None, None, None
