"""Shared helpers: write realistic room logs with the real writer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from logdata import write_logs  # noqa: E402


@pytest.fixture
def logs(tmp_path):
    def make(plans, **kwargs):
        return write_logs(tmp_path / "logs", plans, **kwargs)

    return make
