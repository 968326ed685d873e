"""Cache files shared by processes are written atomically through private temporary files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vkxsplit import cachefile
from vkxsplit.cachefile import atomic_write

WRITER = """
import sys
from vkxsplit.cachefile import atomic_write
path, who = sys.argv[1], sys.argv[2]
for i in range(40):
    atomic_write(path, (who + ":" + str(i) + ":").encode() * 20000)
"""


def test_concurrent_writers_never_mix_or_leave_temporaries(tmp_path: Path) -> None:
    """Four processes saving one file 40 times each at once (as pipeline-cache saves of
    parallel runs do): the file is always one writer's whole payload, and no temporary file is
    left behind (each writer had its own)."""
    target = tmp_path / "pipelines.bin"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(target), f"w{k}"], env=env) for k in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    data = target.read_bytes()
    unit = data[: data.index(b":", data.index(b":") + 1) + 1]
    assert unit.startswith(b"w") and data == unit * 20000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipelines.bin"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "profile.json"
    atomic_write(target, "old")

    def boom(*_a: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(cachefile.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


def test_the_cache_writers_use_it() -> None:
    """The pipeline cache, the device profile and the shader manifest are saved through it
    (a shared ``.tmp`` name lost one save in four processes x six rounds before)."""
    root = Path(__file__).resolve().parent.parent / "vkxsplit"
    for rel in ("vk/device.py", "plan/profile.py", "shaders.py"):
        text = (root / rel).read_text()
        assert "atomic_write(" in text and 'with_suffix(".tmp")' not in text, rel
