"""The rebootstrap fix on the releases whose `pop_preallocated` publishes a rebootstrapped
room's pages (0.5.18-0.5.20): tests/sglang/test_rebootstrap.py on each one's own code,
in a subprocess with the release first on PYTHONPATH (the pattern of test_release_matrix)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_release_matrix import RELEASES, RELEASES_DIR, ROOT, _env

from dsv4_idxk_probe.sglang.targets import release_tuple

POP_PREALLOCATED_RELEASES = [r for r in RELEASES if (0, 5, 18) <= release_tuple(r) < (0, 5, 21)]


def test_the_releases_that_publish_in_pop_preallocated_are_covered():
    assert [r for r in ("0.5.18", "0.5.19", "0.5.20") if r in RELEASES] == POP_PREALLOCATED_RELEASES


@pytest.mark.parametrize("release", POP_PREALLOCATED_RELEASES)
def test_rebootstrap_on_release(release):
    release_dir = RELEASES_DIR / release
    assert (release_dir / ".installed").exists(), f"SGLang {release} is not installed in {release_dir}"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/sglang/test_rebootstrap.py"], cwd=ROOT, env=_env(release_dir),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]
