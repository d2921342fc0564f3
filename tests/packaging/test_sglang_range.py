"""One SGLang version range: the `sglang` extra in pyproject.toml is the range
`sglang/package.py` declares, and every release CI tests lies inside it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from dsv4_idxk_probe.sglang.package import _instruments

REPO = Path(__file__).resolve().parents[2]


def _extra() -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (req,) = project["optional-dependencies"]["sglang"]
    return Requirement(req)


def _tested_releases() -> list[str]:
    lines = (REPO / "requirements" / "sglang-releases.txt").read_text().splitlines()
    older = [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]
    current = re.search(r"sglang==(\S+)", (REPO / "Makefile").read_text()).group(1)
    return older + [current]


def test_the_extra_and_package_py_name_one_range():
    (declared,) = _instruments
    assert _extra().specifier == Requirement(declared).specifier


def test_every_release_ci_runs_is_inside_the_range():
    spec = _extra().specifier
    releases = _tested_releases()
    assert len(releases) >= 2
    assert [r for r in releases if r not in spec] == []
