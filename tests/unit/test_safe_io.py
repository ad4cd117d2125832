"""engine/fs/safe_io.py on its own: what it opens, creates and refuses."""

import os

import pytest

from datastates_megatron.engine import CorruptCheckpointError, FlushError
from datastates_megatron.engine.fs import safe_io


def test_create_temp_replaces_a_stale_regular_temp_but_refuses_a_link(tmp_path):
    stale = tmp_path / "manifest.json.tmp-1"
    stale.write_bytes(b"left by a crash")
    os.close(safe_io.create_temp(str(stale)))
    assert stale.read_bytes() == b""
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "manifest.json.tmp-2"
    os.symlink(target, link)
    with pytest.raises(FlushError, match="symlink") as e:
        safe_io.create_temp(str(link))
    assert str(link) in str(e.value) and os.path.islink(link) and target.read_bytes() == b"keep"


def test_open_for_write_refuses_links_fifos_and_directories(tmp_path):
    os.symlink(tmp_path / "elsewhere", tmp_path / "dangling")  # O_CREAT would create the target
    os.mkfifo(tmp_path / "fifo")
    os.mkdir(tmp_path / "dir")
    for name, what in (("dangling", "symlink"), ("fifo", "FIFO"), ("dir", "directory")):
        with pytest.raises(FlushError, match=what):
            safe_io.open_for_write(str(tmp_path / name))
    assert not os.path.exists(tmp_path / "elsewhere")


def test_read_capped_reads_a_regular_file_and_refuses_more_than_the_cap(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    assert safe_io.read_capped(str(f), 10, "tracker") == b"x" * 10
    with pytest.raises(CorruptCheckpointError, match="larger than 9 bytes"):
        safe_io.read_capped(str(f), 9, "tracker")
    with pytest.raises(FileNotFoundError):
        safe_io.read_capped(str(tmp_path / "absent"), 9, "tracker")


def test_make_dir_refuses_a_symlinked_directory(tmp_path):
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "iter_0000002")
    with pytest.raises(FlushError, match="symlink"):
        safe_io.make_dir(str(tmp_path / "iter_0000002"))
    safe_io.make_dir(str(tmp_path / "a" / "b"))
    assert safe_io.real_dir(str(tmp_path / "a" / "b"))
