"""What `pip install dsv4-idxk-probe` adds to a serving image: under 10 MB beyond SGLang's own
dependencies, and none of the image's packages replaced.

The serving image is stood in for by a fresh venv that sees SGLang's dependency closure (the
distributions this environment has that SGLang 0.5.23 requires, transitively, without extras)
through a folder of links; nothing else of this environment is visible. The wheel built from
this checkout is installed into it (`--no-deps`), then each of its requirements (and theirs)
that nothing visible satisfies, one by one: copied file by file from this environment, where
`make test` installed it at the pinned version, else from the package index. (pip's own
resolver would also fetch the CUDA libraries torch names that this CPU test environment
lacks, which a serving image has.) What landed in the venv is measured on disk.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 10_000_000  # "adds < 10 MB"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sglang_closure() -> dict[str, md.Distribution]:
    """SGLang and what it requires, transitively, among the installed distributions."""
    installed = {_norm(d.metadata["Name"]): d for d in md.distributions()}
    assert "sglang" in installed, "SGLang is not installed here: run `make install-sglang` (`make test` does)"
    seen: dict[str, md.Distribution] = {}
    stack = ["sglang"]
    while stack:
        name = stack.pop()
        if name in seen or name not in installed:
            continue
        dist = seen[name] = installed[name]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(_norm(req.name))
    return seen


def link_view(dists: dict[str, md.Distribution], view: Path) -> None:
    """`view` holds links to each distribution's top-level files and its metadata folder."""
    view.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        meta = getattr(dist, "_path", None)
        if meta is not None:
            tops.add(Path(meta).name)
        for top in tops:
            src, dst = base / top, view / top
            if src.exists() and not os.path.lexists(dst):
                dst.symlink_to(src)


def sh(*cmd, env, timeout=900):
    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def install_with_missing_requirements(pip, python, site, wheel, closure, env) -> list[str]:
    """Install `wheel`, then every requirement (no extras) nothing visible satisfies, transitively;
    the names installed, in order."""
    constraints = ["-c", REPO / "requirements" / "constraints.txt"]
    sh(*pip, "--python", python, "install", "-q", "--no-deps", wheel, env=env)
    done = ["dsv4-idxk-probe"]
    pending = list(_dist_in(site, "dsv4-idxk-probe").requires or [])
    while pending:
        req = Requirement(pending.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = {**{n: d.version for n, d in closure.items()},
                **{_norm(d.metadata["Name"]): d.version for d in md.distributions(path=[str(site)])}}
        name = _norm(req.name)
        if name in have and req.specifier.contains(have[name], prereleases=True):
            continue
        here = _installed_here(name)
        if here is not None and req.specifier.contains(here.version, prereleases=True):
            copy_distribution(here, site)
        else:
            sh(*pip, "--python", python, "install", "-q", "--no-deps", *constraints, str(req), env=env)
        done.append(name)
        pending.extend(_dist_in(site, name).requires or [])
    return done


def _installed_here(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def copy_distribution(dist: md.Distribution, site: Path) -> None:
    """Install `dist` into `site` as pip would have: each file its RECORD lists, copied."""
    for f in dist.files or []:
        if str(f).startswith("..") or "__pycache__" in Path(str(f)).parts:
            continue
        src, dst = Path(dist.locate_file(f)), site / str(f)
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _dist_in(site: Path, name: str) -> md.Distribution:
    return next(d for d in md.distributions(path=[str(site)]) if _norm(d.metadata["Name"]) == name)


def tree_files(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = path.lstat().st_size
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("image")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_IDXK_PROBE", "PYTHONPATH", "PROMETHEUS"))}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    sh(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "dist", REPO, env=env)
    (wheel,) = (root / "dist").glob("dsv4_idxk_probe-*.whl")
    closure = sglang_closure()
    link_view(closure, root / "sglang-deps")
    venv = root / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", venv, env=env)
    python = venv / "bin" / "python"
    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=env).stdout.strip())
    (site / "zz_sglang_dependencies.pth").write_text(f"{root / 'sglang-deps'}\n")
    before = tree_files(venv)
    installed_names = install_with_missing_requirements(pip, python, site, wheel, closure, env)
    after = tree_files(venv)
    added = {path: size for path, size in after.items() if path not in before}
    return python, env, closure, added, installed_names


def test_the_wheel_adds_under_10_mb_to_an_image_with_sglangs_dependencies(installed):
    *_, added, names = installed
    total = sum(added.values())
    print(f"the wheel added {total / 1e6:.2f} MB: {', '.join(names)}")
    assert total < LIMIT_BYTES, f"{total / 1e6:.1f} MB added ({', '.join(names)})"


def test_pip_replaces_nothing_the_image_has(installed):
    _, _, closure, _, names = installed
    assert [name for name in names if name in closure] == []
    assert names[0] == "dsv4-idxk-probe"


def test_the_probe_imports_and_patches_nothing_without_its_variable(installed):
    python, env, *_ = installed
    code = ("import dsv4_idxk_probe.activation, dsv4_idxk_probe.config, dsv4_idxk_probe.runtime, sys; "
            "print(sorted(m for m in ('nixl', 'rich') if m in sys.modules))")
    assert sh(python, "-c", code, env=env).stdout.strip() == "[]"
