"""The SGLang-facing tests on every older release the target table lists.

`make test` installs each release --no-deps into build/sglang/<release>/
(requirements/sglang-releases.txt names the pinned modules it needs beside
it) and points DSV4_IDXK_PROBE_RELEASES_DIR there. Each release runs in its
own subprocess with its directory first on PYTHONPATH, ahead of the venv's
sglang==0.5.23: `dsv4-idxk-probe check` must exit 0 with every target of the
release's table resolving, and the SGLang-facing subset must pass. The
installed 0.5.23 runs the whole suite in the parent run. The runs go two at a time
(release_runs.py: what each release runs, SUBSET).
"""

from __future__ import annotations

import re

import pytest
from release_runs import RELEASES, ROOT

from dsv4_idxk_probe.sglang.targets import release_tuple, select_table


def test_every_listed_older_release_is_in_the_matrix():
    listed = [line.split()[0] for line in (ROOT / "requirements" / "sglang-releases.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    assert sorted(listed, key=release_tuple) == sorted(RELEASES, key=release_tuple)


@pytest.mark.parametrize("release", RELEASES)
def test_release(release, release_runs):
    run = release_runs.result("matrix", release)
    assert run.missing is None, run.missing
    check = run.results[0]
    assert check.returncode == 0, check.stdout + check.stderr
    n = len(select_table(f"sglang@{release}").targets)
    assert f"SGLang {release} detected" in check.stdout and f"table sglang@{release} chosen" in check.stdout
    assert re.search(rf"^{n}/{n} targets resolve; 0 required target\(s\) missing", check.stdout, re.M), check.stdout
    (tests,) = run.results[1:]
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout
