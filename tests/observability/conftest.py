"""Shared helpers: write realistic room logs with the real writer."""

from __future__ import annotations

import pytest

from tests.support.logdata import write_logs


@pytest.fixture
def logs(tmp_path):
    def make(plans, **kwargs):
        return write_logs(tmp_path / "logs", plans, **kwargs)

    return make
