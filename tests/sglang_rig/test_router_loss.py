"""Requests SGLang's router lost on one leg (testbed/sglang/router_loss.py, no servers): only
the whole signature counts (the client timed out, one side timed out waiting for the other,
the other never named the rid), so a request lost anywhere else still fails its phase; and a
phase sends such a request once more under a new rid."""

from __future__ import annotations

from types import SimpleNamespace

from dsv4_idxk_probe.testbed.sglang import router_loss
from dsv4_idxk_probe.testbed.sglang.run import RigSession
from dsv4_idxk_probe.testbed.sglang.workload import Outcome, Request

# prefill's line as SGLang 0.5.23 logs it (a fresh-clone run, 2026-12-06)
BOOTSTRAP_TIMEOUT = ("[2026-12-06 10:22:11] Prefill bootstrap failed for request rank=0 req.rid='abort-3' "
                     "req.bootstrap_room=2523064250658496015 with exception KVTransferError(bootstrap_room="
                     "2523064250658496015): Request 2523064250658496015 timed out after 300.0s in "
                     "KVPoll.Bootstrapping\n")
TIMED_OUT = "TimeoutError: timed out"


def logs(tmp_path, prefill: str, decode: str):
    (tmp_path / "prefill.log").write_text(prefill)
    (tmp_path / "decode.log").write_text(decode)
    return tmp_path / "prefill.log", tmp_path / "decode.log"


def outcome(rid="abort-3", status=None, error=TIMED_OUT, **request):
    return Outcome(Request(3, rid, (1, 2, 3), 8, **request), status=status, error=error)


def test_the_whole_signature_is_a_router_loss(tmp_path):
    prefill, decode = logs(tmp_path, BOOTSTRAP_TIMEOUT, "[...] Abort request obj.rid='abort-13'\n")
    assert router_loss.lost_by_router(outcome(), prefill, decode, wait_s=0)


def test_anything_less_is_not(tmp_path):
    prefill, decode = logs(tmp_path, BOOTSTRAP_TIMEOUT, "")
    assert not router_loss.lost_by_router(outcome(status=500, error="boom"), prefill, decode, wait_s=0)
    assert not router_loss.lost_by_router(outcome(abort_after_s=1.0), prefill, decode, wait_s=0)
    assert not router_loss.lost_by_router(outcome(rid="abort-4"), prefill, decode, wait_s=0)
    assert not router_loss.lost_by_router(outcome(rid="abort-30"), prefill, decode, wait_s=0)
    prefill, decode = logs(tmp_path, BOOTSTRAP_TIMEOUT, "[...] Abort request obj.rid='abort-3'\n")
    assert not router_loss.lost_by_router(outcome(), prefill, decode, wait_s=0)  # decode had it
    prefill, decode = logs(tmp_path, BOOTSTRAP_TIMEOUT.replace("KVPoll.Bootstrapping", "KVPoll.Transferring"), "")
    assert not router_loss.lost_by_router(outcome(), prefill, decode, wait_s=0)


# decode's line as SGLang 0.5.23 logs it (a fresh-clone run, 2026-12-06: the prefill leg lost)
TRANSFER_TIMEOUT = ("[2026-12-06 17:29:23] Decode transfer failed for request rank=0 decode_req.req.rid='abort-3' "
                    "decode_req.req.bootstrap_room=445518024391207756 with exception KVTransferError(bootstrap_room="
                    "445518024391207756): Request 445518024391207756 timed out after 300.0s in KVPoll.WaitingForInput\n")


def test_the_prefill_leg_lost_is_a_router_loss_too_and_only_whole(tmp_path):
    prefill, decode = logs(tmp_path, "", TRANSFER_TIMEOUT)
    assert router_loss.lost_by_router(outcome(), prefill, decode, wait_s=0)
    assert not router_loss.lost_by_router(outcome(status=500, error="boom"), prefill, decode, wait_s=0)
    assert not router_loss.lost_by_router(outcome(rid="abort-4"), prefill, decode, wait_s=0)
    prefill, decode = logs(tmp_path, "[...] req.rid='abort-3' sent\n", TRANSFER_TIMEOUT)
    assert not router_loss.lost_by_router(outcome(), prefill, decode, wait_s=0)  # prefill had it
    prefill, decode = logs(tmp_path, "", TRANSFER_TIMEOUT.replace("KVPoll.WaitingForInput", "KVPoll.Transferring"))
    assert not router_loss.lost_by_router(outcome(), prefill, decode, wait_s=0)


class LossyRouter(RigSession):
    """A session whose first send loses request 3 before decode, as the router did."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.cluster = SimpleNamespace(url="http://router", logs=dict(zip(("prefill", "decode"), logs(
            tmp_path, BOOTSTRAP_TIMEOUT, ""))))
        self.sent: list[list[str]] = []


def test_a_phase_sends_a_request_the_router_lost_once_more_under_a_new_rid(tmp_path, monkeypatch):
    from dsv4_idxk_probe.testbed.sglang import run

    session = LossyRouter(tmp_path)

    def send(url, requests, concurrency):
        session.sent.append([r.rid for r in requests])
        return [Outcome(r) if r.rid == "abort-3" else Outcome(r, status=200) for r in requests]

    monkeypatch.setattr(run, "send", send)
    requests = [Request(n, f"abort-{n}", (1, 2, 3), 8) for n in (1, 3)]
    again, outcomes, lost = session._resend_router_lost(
        requests, [Outcome(requests[0], status=200), outcome()], 4,
        {"faults": None, "scribble_freed": False, "fail_transfer": []})
    assert session.sent == [["abort-3-resent"]]
    assert lost == ["abort-3"] and [r.rid for r in again] == ["abort-1", "abort-3-resent"]
    assert [(o.request.rid, o.status) for o in outcomes] == [("abort-1", 200), ("abort-3-resent", 200)]
    assert session.rooms["abort-3-resent"] == 3
