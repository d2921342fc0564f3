"""The SGLang-facing tests on every older release the target table lists.

`make test` installs each release --no-deps into build/sglang/<release>/
(requirements/sglang-releases.txt names the pinned modules it needs beside
it) and points DSV4_IDXK_PROBE_RELEASES_DIR there. Each release runs in its
own subprocess with its directory first on PYTHONPATH, ahead of the venv's
sglang==0.5.23: `dsv4-idxk-probe check` must exit 0 with every target of the
release's table resolving, and the SGLang-facing subset must pass. The
installed 0.5.23 runs the whole suite in the parent run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_idxk_probe.sglang.targets import installed_sglang, release_tuple, select_table

ROOT = Path(__file__).resolve().parents[2]
RELEASES_DIR = Path(os.environ.get("DSV4_IDXK_PROBE_RELEASES_DIR", ROOT / "build" / "sglang"))
if not RELEASES_DIR.is_absolute():
    RELEASES_DIR = ROOT / RELEASES_DIR


def _listed() -> list[str]:
    from dsv4_idxk_probe.sglang.targets import read_table

    return list(read_table(Path(select_table("sglang").source)).releases)


RELEASES = [r for r in _listed() if r != installed_sglang()]

#: Tests of the SGLang-facing code that run on every release: `check`, table
#: choice, resolution and signatures, the fork layout, index-K geometry of the
#: real pools, the decode commit and slot handling on real classes, the PD hook
#: flow through SGLang's real send path (`send_kv_chunk` / `_send_kv_chunk`, the
#: NIXL and Mooncake senders), `_send_kv_metadata` (0.5.21+) and commit, and the
#: HiCache host-pool hooks on each release's own DeepSeekV4PagedHostPool.
#: A test skips on an older release only where that release lacks the behaviour,
#: with the reason: no pre-transfer snapshot, host-receive or `_verify_kv_checksums`
#: before 0.5.21; no fp4 indexer or `*_physical` entry points before 0.5.21; no
#: `backup_tokens_from_device_all_layer` before 0.5.23. Not here: the rest of
#: tests/sglang/ (the patcher on a fixture module, the enforce all-reduce over
#: gloo, the decode tracking bound: none runs a release's PD or pool classes) and
#: tests/sglang_rig/ (real servers, 0.5.23 only).
SUBSET = ["tests/sglang/test_targets.py", "tests/sglang/test_releases.py", "tests/sglang/test_index_k.py",
          "tests/sglang/test_pd_hooks.py", "tests/hicache"]


def _env(release_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_IDXK_PROBE")}
    env["PYTHONPATH"] = os.pathsep.join([str(release_dir), str(ROOT)])
    return env


def test_every_listed_older_release_is_in_the_matrix():
    listed = [line.split()[0] for line in (ROOT / "requirements" / "sglang-releases.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    assert sorted(listed, key=release_tuple) == sorted(RELEASES, key=release_tuple)


@pytest.mark.parametrize("release", RELEASES)
def test_release(release):
    release_dir = RELEASES_DIR / release
    assert (release_dir / ".installed").exists(), (
        f"SGLang {release} is not installed in {release_dir}: run `make install-sglang-releases` "
        "(`make test` does it)")
    env = _env(release_dir)
    check = subprocess.run([sys.executable, "-m", "dsv4_idxk_probe", "check"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    n = len(select_table(f"sglang@{release}").targets)
    assert f"SGLang {release} detected" in check.stdout and f"table sglang@{release} chosen" in check.stdout
    assert re.search(rf"^{n}/{n} targets resolve; 0 required target\(s\) missing", check.stdout, re.M), check.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
