"""Atomic writes: a reader never sees a half-written file or directory."""

import os
import stat

import pytest

from recurformer.files import atomic_directory, write_json_atomic


def test_atomic_directory_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "unit"
    with atomic_directory(target) as staging:
        (staging / "a.json").write_text("{}")
        assert not target.exists()
    assert (target / "a.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["unit"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask  # as mkdir would make it, not mkdtemp's 0700


def test_atomic_directory_leaves_nothing_after_an_error(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "unit") as staging:
            (staging / "a.json").write_text("{}")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_refuses_an_existing_target(tmp_path):
    write_json_atomic(tmp_path / "unit" / "x.json", {})
    with pytest.raises(FileExistsError, match="exists already"):
        with atomic_directory(tmp_path / "unit"):
            pass
