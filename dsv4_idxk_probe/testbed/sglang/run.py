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

The checks themselves are `sim.verify`'s, the same as the built-in rig's.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..faults.verify import Verification, verify
from . import launch, truth
from .plugin import ENV_OUT, ENV_PLAN
from .workload import Outcome, Request, send


@dataclass
class Phase:
    """What one phase sent and what came back, judged."""

    name: str
    requests: list[Request]
    outcomes: list[Outcome]
    rooms: dict[str, int]  # rid -> bootstrap room (from the oracle's records)
    verification: Verification | None = None
    faults: list[dict] = field(default_factory=list)  # what was injected, in sim.verify's form
    wrong_outputs: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.verification and self.verification.ok) and not self.wrong_outputs and not self.failed_requests


class RigSession:
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
        # diagnosis on: the rig's faults have known diagnoses (docs/diagnosis.md); a test's own
        # `diagnosis:` section, later in the file, wins
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
              settle_s: float = 60.0, check_outputs: bool = True, scribble_freed: bool = False) -> Phase:
        """Send `requests` (their numbers are what `faults` names) and judge their rooms.

        `scribble_freed`: decode zeroes each finished room's pages right after SGLang
        frees them (what a reused page's next writer does); nothing may be reported.
        """
        assert self.cluster is not None, "start() the session first"
        t0 = time.monotonic()
        self.rooms.update({r.rid: r.number for r in requests})
        self._write_plan({r.rid: r.number for r in requests}, str(Path(faults).resolve()) if faults else None,
                         scribble_freed=scribble_freed)
        outcomes = send(self.cluster.url, requests, concurrency)
        phase = Phase(name, requests, outcomes, {})
        for o in outcomes:
            if o.request.abort_after_s is None and o.status != 200:
                phase.failed_requests.append(f"{o.request.rid}: HTTP {o.status} {o.error}")
            elif check_outputs and o.status == 200 and o.output_ids != expected_output(o.request):
                phase.wrong_outputs.append(o.request.rid)
        completed = {o.request.rid for o in outcomes if o.status == 200}
        self._settle(completed, settle_s)
        phase.rooms = self._rooms_of({r.rid for r in requests})
        faults_seen = self._fault_records({r.rid for r in requests})
        oracle = self._oracle_records(set(phase.rooms.values()))
        planned = sorted(phase.rooms[rid] for rid in completed if rid in phase.rooms)
        missing = sorted(rid for rid in completed if rid not in phase.rooms)
        phase.failed_requests += [f"{rid}: decode never digested this room" for rid in missing]
        phase.faults = expectations(faults_seen, oracle)
        phase.verification = verify(self.log_dir, phase.faults, oracle, planned, only_rooms=set(phase.rooms.values()))
        phase.seconds = time.monotonic() - t0
        return phase

    def _settle(self, rids: set[str], timeout_s: float) -> None:
        """Wait until decode digested every completed room at `decode_finish` and the logs caught up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rooms = self._rooms_of(rids)
            finished = {o["room"] for o in self._read("oracle") if o.get("stage") == "decode_finish"}
            if len(rooms) == len(rids) and set(rooms.values()) <= finished and self._logged(set(rooms.values())):
                return
            time.sleep(0.5)

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


def expected_output(request: Request) -> list[int]:
    """What greedy decoding of the stand-in returns: the next-token chain from the prompt's last token."""
    out, token = [], request.input_ids[-1]
    for _ in range(request.max_new_tokens):
        token = truth.next_token(token, launch.VOCAB)
        out.append(token)
    return out


def expectations(fault_records: list[dict], oracle: list[dict]) -> list[dict]:
    """Fault records in `sim.verify`'s form: each changed cell's first stage is the first
    oracle point, at or after the fault, that sees the cell changed (None: no point does)."""
    points: dict[int, list[dict]] = {}
    for o in oracle:
        points.setdefault(int(o["room"]), []).append(o)
    for ps in points.values():
        ps.sort(key=lambda o: o.get("index", 0))
    merged: dict[tuple[int, Any], dict] = {}
    for f in fault_records:
        room = f.get("room")
        key = (f["fault"], f.get("partner_of") or f.get("rid"))
        record = merged.setdefault(key, {
            "fault": f["fault"], "name": f["name"], "kind": f["kind"], "when": f["when"],
            "after_step": f["after_step"], "side": f["side"], "room": room if not f.get("partner_of") else None,
            "rig_room": f.get("rig_room"), "applied": f["applied"], "reason": f.get("reason", ""),
            "target": f.get("target", {}), "effects": [],
        })
        if not f.get("partner_of"):
            record.update(room=room, rig_room=f.get("rig_room"), applied=f["applied"], reason=f.get("reason", ""))
        if f.get("roundtrip"):  # what HiCache round-trip mode must report (an in_host_pool fault)
            record["roundtrip"] = f["roundtrip"]
        # changed before prefill's digest (in the host pool, before the load): both sides digest
        # the changed bytes, so no digest point may report it; the oracle still sees it on decode
        upstream = f["when"] == "in_host_pool"
        expect = {(e[0], e[1], e[2]): e[3:] for e in f.get("expect", [])}
        for layer, page, segment in f.get("cells", []):
            stage, step, tokens = _first_seen(points.get(int(room), []) if room is not None else [], f.get("point", 0),
                                              (layer, page, segment))
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
