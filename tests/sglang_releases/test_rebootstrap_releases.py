"""The rebootstrap fix on the releases whose `pop_preallocated` publishes a rebootstrapped
room's pages (0.5.18-0.5.20): tests/sglang/test_rebootstrap.py on each one's own code,
in a subprocess with the release first on PYTHONPATH (release_runs.py)."""

from __future__ import annotations

import pytest
from release_runs import POP_PREALLOCATED_RELEASES, RELEASES


def test_the_releases_that_publish_in_pop_preallocated_are_covered():
    assert [r for r in ("0.5.18", "0.5.19", "0.5.20") if r in RELEASES] == POP_PREALLOCATED_RELEASES


@pytest.mark.parametrize("release", POP_PREALLOCATED_RELEASES)
def test_rebootstrap_on_release(release, release_runs):
    run = release_runs.result("rebootstrap", release)
    assert run.missing is None, run.missing
    (tests,) = run.results
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-2000:]
    assert "2 passed" in tests.stdout, tests.stdout[-2000:]
