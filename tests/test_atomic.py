"""matex._atomic: a file is replaced whole or not at all, and a failed write leaves no litter."""

import os

import pytest

from matex import _atomic


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "deep" / "status.json"
    assert _atomic.write(path, "one", mkdir=True) == str(path)
    _atomic.write(path, b"two")
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["status.json"]


def test_a_failed_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "plot.png"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with _atomic.replacing(path) as tmp:
            assert tmp.endswith(".png") and os.path.dirname(tmp) == str(tmp_path)
            with open(tmp, "w") as f:
                f.write("half")
            raise RuntimeError("killed midway")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["plot.png"]
