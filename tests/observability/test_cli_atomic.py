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


def test_a_path_that_is_not_a_regular_file_is_refused_and_left_as_it_was(tmp_path):
    """`report -o /dev/full` printed "wrote", and the rename put a plain file where the device
    node was (found by review); a FIFO or a directory likewise."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    for path in (fifo, tmp_path / "folder"):
        with pytest.raises(OSError, match="not a regular file"):
            write_atomically(path, b"x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (tmp_path / "folder").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pipe"]  # no temp file left


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    real, link = tmp_path / "real.html", tmp_path / "link.html"
    real.write_text("old")
    link.symlink_to(real)
    write_atomically(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
