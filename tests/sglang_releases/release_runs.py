"""The older releases' subprocess runs, two at a time.

Each run is one Python process with a release first on PYTHONPATH (`env_for`), and
nearly all of its time one thread's CPU (SGLang's imports, the subset's tests); the CI
machine has two cores and the parent pytest only waits, so two runs at once take about
half the wall time of one after another. Every run is submitted when the first test
asks for one (`Runs.start`), longest first, and each test waits for its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsv4_idxk_probe.sglang.targets import installed_sglang, read_table, release_tuple, select_table

ROOT = Path(__file__).resolve().parents[2]
RELEASES_DIR = Path(os.environ.get("DSV4_IDXK_PROBE_RELEASES_DIR", ROOT / "build" / "sglang"))
if not RELEASES_DIR.is_absolute():
    RELEASES_DIR = ROOT / RELEASES_DIR

#: Runs at once: the CI machine's two cores.
PARALLEL_RUNS = 2


def listed_releases() -> list[str]:
    return list(read_table(Path(select_table("sglang").source)).releases)


RELEASES = [r for r in listed_releases() if r != installed_sglang()]


def env_for(release_dir: Path) -> dict:
    """The parent's environment, the release first on PYTHONPATH, one OpenMP thread (two runs
    share two cores; torch's thread pool would otherwise spin on both)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_IDXK_PROBE")}
    env["PYTHONPATH"] = os.pathsep.join([str(release_dir), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclass
class Run:
    """One release's commands, in order; a run stops at the first that fails."""

    release: str
    commands: list[list[str]]
    timeout_s: float
    results: list[subprocess.CompletedProcess] | None = None
    missing: str | None = None  # the release is not installed: why

    def __call__(self) -> "Run":
        release_dir = RELEASES_DIR / self.release
        if not (release_dir / ".installed").exists():
            self.missing = (f"SGLang {self.release} is not installed in {release_dir}: run "
                            "`make install-sglang-releases` (`make test` does it)")
            return self
        self.results = []
        for args in self.commands:
            done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env_for(release_dir),
                                  capture_output=True, text=True, timeout=self.timeout_s)
            self.results.append(done)
            if done.returncode != 0:
                break
        return self


class Runs:
    """Every run of the module's tests, submitted at once to a pool of PARALLEL_RUNS."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL_RUNS, thread_name_prefix="release-run")
        self._futures: dict[tuple[str, str], Future] = {}

    def start(self, runs: dict[tuple[str, str], Run]) -> None:
        for key, run in runs.items():
            self._futures[key] = self._pool.submit(run)

    def result(self, kind: str, release: str) -> Run:
        return self._futures[(kind, release)].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def pytest_args(*paths: str) -> list[str]:
    return ["-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]


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

#: The releases whose `pop_preallocated` publishes a rebootstrapped room's pages
#: (0.5.18-0.5.20): tests/sglang/test_rebootstrap.py runs on each one's own code.
POP_PREALLOCATED_RELEASES = [r for r in RELEASES if (0, 5, 18) <= release_tuple(r) < (0, 5, 21)]


def every_run() -> dict[tuple[str, str], Run]:
    """The matrix's runs (`check`, then the subset), then the rebootstrap runs: longest first."""
    runs = {("matrix", r): Run(r, [["-m", "dsv4_idxk_probe", "check"], pytest_args(*SUBSET)], timeout_s=900)
            for r in RELEASES}
    runs.update({("rebootstrap", r): Run(r, [pytest_args("tests/sglang/test_rebootstrap.py")], timeout_s=600)
                 for r in POP_PREALLOCATED_RELEASES})
    return runs
