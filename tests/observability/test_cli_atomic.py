"""The CLI's one atomic write (cli/atomic.py): whole file or none, mode independent of the umask."""

import os
import stat

import pytest

from dsv4_idxk_probe.cli.atomic import write_atomically


def test_a_written_file_is_0644_under_any_umask_and_replaces_the_old_one(tmp_path):
    target = tmp_path / "page.html"
    target.write_text("old")
    old_umask = os.umask(0o077)
    try:
        write_atomically(target, "new ü")
    finally:
        os.umask(old_umask)
    assert target.read_text(encoding="utf-8") == "new ü"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "rules.yml"
    target.write_bytes(b"kept")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_atomically(target, b"lost")
    assert target.read_bytes() == b"kept"
    assert [p.name for p in tmp_path.iterdir()] == ["rules.yml"]
