"""Synchronization validation (the layer's hazard checks between commands): a child process
with it on (VK_LAYER_ENABLES, read at instance creation) shows that a write-after-write with no
barrier between is reported, the sequences' own barriers keep the same commands clean, and a
model step under each split mode is clean. The rest of the suite runs with synchronization
validation on too (tests/conftest.py); this file stands in for any module listed in its
``CORE_VALIDATION_ONLY``, and checks that the layer does see a hazard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, sys
import numpy as np
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.device import Device

out = {}
with Device.open() as dev:
    def two_fills(barriers):
        with dev.memory.alloc(4096, "device", name="sync-probe") as buf:
            seq = Sequence(dev)
            try:
                if not barriers:
                    seq._touch = lambda *a, **k: None  # no barrier recorded between the fills
                seq.fill(buf, 1)
                seq.fill(buf, 2)
                seq.end()
                seq.run(60)
            finally:
                seq.close()
        msgs = dev.instance.messages
        dev.instance.clear_messages()
        return msgs

    out["clean"] = two_fills(True)
    out["hazard"] = two_fills(False)
    if len(sys.argv) > 1:
        from vkxsplit.model import load_model
        for split in sys.argv[2].split(";"):
            backends = None if split == "none" else "cpu"
            with load_model(sys.argv[1], device=dev, n_ctx=32, ubatch=8, split=split, backends=backends) as m:
                m.logits([1, 2, 3, 4, 5, 6, 7, 8, 9])  # a prefill step of 8 and one of 1
                m.run_step([10])
            out[split] = dev.instance.messages
            dev.instance.clear_messages()
print("RESULT " + json.dumps(out))
"""


def _child(tmp_path: Path, *args: str) -> dict:
    env = dict(os.environ, VKXSPLIT_VALIDATION="1",
               VK_LAYER_ENABLES="VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT",
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    line = next((li for li in r.stdout.splitlines() if li.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_sync_validation_reports_a_missing_barrier(tmp_path: Path) -> None:
    got = _child(tmp_path)
    if not any("SYNC-" in m for m in got["hazard"]):
        pytest.skip("this validation layer does not report synchronization hazards")
    assert got["clean"] == []
    assert any("SYNC-HAZARD-WRITE-AFTER-WRITE" in m for m in got["hazard"]), got["hazard"]


def test_model_steps_are_sync_validation_clean(tmp_path: Path) -> None:
    """A tiny model's prefill and decode steps under each split mode (the cpu backend for the
    splits): no synchronization hazard and no other validation message."""
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp_path / "sync.gguf", "smol135m", "q8_0", seed=2, n_vocab=300, n_layer=1)
    splits = "none;layer:1,1;tensor:1,1;mode:cpu>=8"
    got = _child(tmp_path, str(path), splits)
    for split in splits.split(";"):
        assert got[split] == [], (split, got[split])
