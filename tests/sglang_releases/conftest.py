"""The releases' runs, shared by both modules: all submitted when the first test asks,
two at a time (release_runs.py)."""

from __future__ import annotations

import pytest
from release_runs import Runs, every_run


@pytest.fixture(scope="session")
def release_runs():
    runs = Runs()
    runs.start(every_run())
    yield runs
    runs.close()
