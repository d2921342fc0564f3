"""HiCache on prefill (`--enable-hierarchical-cache`, direct io backend, layer_first):
SGLang's own DeepSeek-V4 host pools back device pages up and load them back for
prefix hits, through the wrapped backup/load methods and the probe's branch counters.
Every room's index-K is backed up page by page (the page-aligned branch, counted); the
host-to-device load needs a prefix hit, which this rig does not get (docs/rig.md).

HiCache on decode cannot run with DeepSeek-V4 on SGLang 0.5.23 (decode's radix cache
with HiCache is refused for sliding-window models; docs/rig.md), so neither can
host-receive decode; test_sglang_refusals.py shows it."""

from __future__ import annotations

import time

from dsv4_idxk_probe.sglang.rig import launch, workload
from dsv4_idxk_probe.sglang.rig.workload import Request

from .conftest import describe, pair_fixture

# a small device pool on prefill, so the radix cache evicts to the host pool
OPTIONS = launch.ServerOptions(prefill_hicache=True, extra_prefill=("--max-total-tokens", "16384"))
INDEXER_POOL = "deepseek_v4_c4_indexer"


rig = pair_fixture("sglang-hicache", OPTIONS)


def copies(session, direction: str, branch: str, pool: str = INDEXER_POOL) -> float:
    status, body = launch.http_get(session.cluster.server_url("prefill") + "/metrics", timeout=10)
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("dsv4_idxk_probe_hicache_copies_total{") and f'pool="{pool}"' in line \
                and f'direction="{direction}"' in line and f'branch="{branch}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_rooms_backed_up_to_the_host_pool_take_the_page_branch_and_still_match_on_decode(rig):
    first = workload.plan("hicache", workload.WorkloadOptions(rooms=24, seed=8, min_prompt=1500, max_new_tokens=12,
                                                              shared_prefix_share=0.0))
    phase = rig.phase("fill", first)
    assert phase.ok, describe(phase)
    deadline = time.monotonic() + 60  # HiCache backs up behind the forward, and the probe's flusher publishes later
    while copies(rig, "d2h", "page") == 0 and time.monotonic() < deadline:
        time.sleep(1.0)
    assert copies(rig, "d2h", "page") > 0, "nothing was backed up to the host pool"
    # The same prompts again: SGLang 0.5.23 gave these DeepSeek-V4 prompts no prefix hit on this
    # rig (#cached-token 0 in prefill's log), so the host-to-device load path is not reached here
    # (docs/rig.md); the rooms must still match, and index-K never takes the token-granular branch.
    again = [Request(100 + r.number, f"again-{r.number}", r.input_ids, r.max_new_tokens) for r in first[:8]]
    phase = rig.phase("again", again)
    assert phase.ok, describe(phase)
    assert copies(rig, "d2h", "token") == 0 and copies(rig, "h2d", "token") == 0  # index-K stayed page-aligned
    assert phase.verification.verdicts == {"match": 8}, describe(phase)
