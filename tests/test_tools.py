"""The device benchmark scripts run here too (small shapes), so they do not rot between the
scarce runs on the lent GPU: each exits 0 and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_tool(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, VKXSPLIT_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=path)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_bench_kernels_quick(tmp_path):
    r = run_tool(["tools/bench_kernels.py", "--quick"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compute-shader copy" in r.stdout and "| q4_0 |" in r.stdout and "mat-mat" in r.stdout
    assert "| q4_0 | 512x1024 | f32 x" in r.stdout and "| weights of |" in r.stdout


def test_bench_models_tiny(tmp_path):
    r = run_tool(["tools/bench_models.py", "--shapes", "smol135m:q4_1", "-p", "8", "-n", "2", "-r", "1",
                  "--dir", str(tmp_path / "models"), "--server", str(tmp_path / "no-server")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    row = [ln for ln in r.stdout.splitlines() if ln.startswith("| smol135m | q4_1 |")]
    assert row and "error" not in r.stdout, r.stdout[-2000:]
    assert row[0].split("|")[3].strip() == "`none`" and float(row[0].split("|")[4]) > 0  # split, pp8 tok/s


def test_bench_planner_quick(tmp_path):
    r = run_tool(["tools/bench_planner.py", "--quick"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "auto picks" in r.stdout and "| `none` |" in r.stdout


def test_bench_handoff_names_the_missing_cuda(tmp_path):
    from vkxsplit.backend import backend_availability

    if backend_availability(["cuda"])["cuda"]:
        pytest.skip("CUDA is present: the benchmark would run for real")
    r = run_tool(["tools/bench_handoff.py"], tmp_path)
    assert r.returncode == 2 and "no cuda backend" in r.stderr and "Traceback" not in r.stderr


def test_bench_coopmat_quick(tmp_path):
    """The coopmat sweep: on a device without cooperative matrices it checks and times the
    emulated variants; every variant must PASS its numpy check."""
    r = run_tool(["tools/bench_coopmat.py", "--quick"], tmp_path)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "| PASS |" in r.stdout and "FAIL" not in r.stdout
    assert "split K by" in r.stdout  # the split-K check of each default variant
    assert "| q4_0 | 64 | 128x256 |" in r.stdout and "fastest per type" in r.stdout


def test_bench_matvec_quick(tmp_path):
    r = run_tool(["tools/bench_matvec.py", "--quick"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "copy_vec4" in r.stdout and "FAIL" not in r.stdout and "| PASS |" in r.stdout
    for t in ("q4_0", "q8_0", "q4_1", "q4_k", "q6_k", "f16"):
        # the fastest M = 1 variant of the type: an f32-x one, or (Q4_0/Q8_0) an 8-bit-x one
        assert (f"- {t}: `mul_mat_vec_{t}_f32" in r.stdout
                or f"- {t}: `mul_mat_vecq_{t}_q8_1" in r.stdout), r.stdout[-2000:]
        assert f"| {t} | 256x1024 | 1 |" in r.stdout and f"| {t} | 256x1024 | 4 |" in r.stdout


def test_bench_coopmat_splits_and_tiles(tmp_path):
    """--splits with counts and --tiles: each listed tiling timed once per count, plus the
    "chosen" row only where real cooperative matrices exist (lavapipe: emulated, none). The
    tiling: the default one of the kernels the device runs (emulated or real)."""
    import kernels

    import vkxsplit.ops.mul_mat as mm
    from vkxsplit.vk.device import Device

    with Device.open() as d:
        emulate = not mm.coopmat_available(d)
    tile = (kernels.COOP_EMU_TILE if emulate else mm.COOP_TILES[mm.COOP_CONFIG["q4_0"]]).name
    r = run_tool(["tools/bench_coopmat.py", "--quick", "--types", "q4_0", "--splits", "1,2",
                  "--tiles", tile], tmp_path)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    rows = [ln for ln in r.stdout.splitlines()
            if ln.startswith("| q4_0 | 64 | 128x256 |") and f"| {tile}" in ln]
    assert len(rows) == 2 and "split K 2x128" in rows[1] and "split K" not in rows[0], rows


def test_bench_matvec_variants_and_floor(tmp_path):
    """--variants filters the sweep (the defaults always stay), --shapes picks the shape; the
    per-dispatch floor table is printed for the device's decode default."""
    r = run_tool(["tools/bench_matvec.py", "--quick", "--types", "q4_0", "--variants", "nomatch",
                  "--shapes", "128x512"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| q4_0 | 128x512 | 1 |" in r.stdout and "per-dispatch floor" in r.stdout
    assert "_wide_" not in r.stdout  # filtered out


def test_bench_ab_tiny(tmp_path):
    """The kill-switch A/B: one row per setting (separated by ';': a VKXSPLIT_DISABLE value is a
    comma list), the baseline first, tok/s numbers."""
    r = run_tool(["tools/bench_ab.py", "--shapes", "smol135m:q4_1", "--settings",
                  "none;VKXSPLIT_DISABLE=intdot,fusion", "-p", "8", "-n", "2", "-r", "1",
                  "--dir", str(tmp_path / "models")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split("|") for ln in r.stdout.splitlines() if ln.startswith("| smol135m q4_1 |")]
    assert [row[2].strip() for row in rows] == ["none", "VKXSPLIT_DISABLE=intdot,fusion"]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)
    bad = run_tool(["tools/bench_ab.py", "--settings", "FOO=1"], tmp_path)
    assert bad.returncode == 2 and "VKXSPLIT_NAME=VALUE" in bad.stderr


def test_bench_multigpu_quick(tmp_path):
    """The one-vs-two-GPU bench with both hubs on the one lavapipe device (the tiny synthetic
    shape: 256 wide, 4 layers): the layer split (its bytes crossed: 8 prompt tokens of 256 f32 =
    8 KiB, one decode token 1 KiB, one relay round per micro-batch) and the row split (both
    partials of every all-reduce)."""
    r = run_tool(["tools/bench_multigpu.py", "--quick", "--shape", "tiny", "--splits", "tensor:1,1;pipeline:1,1:m1",
                  "--dir", str(tmp_path / "m")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]

    def cells(name):
        row = [ln for ln in r.stdout.splitlines() if ln.startswith(f"| `{name}` |")]
        assert row, r.stdout[-2000:]
        return [c.strip() for c in row[0].split("|")]

    c = cells("tensor:1,1")
    assert float(c[3]) > 0 and float(c[4]) > 0  # pp, tg t/s
    E, n_layer = 256, 4  # an all-reduce after each attention and FFN, both partials crossing
    assert c[5] == f"{8 * E * 4 * 2 * 2 * n_layer / 2**20:.2f}" and c[7] == f"{2 * n_layer} / {2 * n_layer}"
    c = cells("pipeline:1,1:m1")
    assert float(c[3]) > 0 and float(c[4]) > 0
    assert c[5] == f"{8 * E * 4 / 2**20:.2f}" and c[6] == f"{E * 4 / 2**20:.2f}" and c[7] == "1 / 1"


def test_bench_warm_up_runs_until_the_gpu_is_warm(monkeypatch):
    """bench's warm-up: one run on a CPU device (no clocks to raise), repeated runs for
    WARMUP_S on a GPU (a short step after an idle phase runs at low clocks)."""
    import types

    from vkxsplit import bench
    monkeypatch.setattr(bench, "WARMUP_S", 0.05)
    for cpu, at_least in ((True, 1), (False, 3)):
        model = types.SimpleNamespace(device=types.SimpleNamespace(is_cpu=cpu))
        calls = []

        def run(calls=calls):
            calls.append(time.perf_counter())
            time.sleep(0.01)

        bench._warm(model, run)
        assert len(calls) >= at_least and (not cpu or len(calls) == 1)


def test_bench_link_quick(tmp_path):
    """The cross-device link bench on two VkDevices of the one device: every table printed, the
    host-relayed exchange exact (no wrong element). The flag all-reduce is exact with no give-up
    on CPU devices (lavapipe: one coherent memory); on a GPU it is what the bench measures (on the
    H200 two VkDevices of one GPU never see each other's flag writes: docs/MULTI_GPU.md), so
    there only the row's shape is checked."""
    import json as _json

    from vkxsplit.vk.device import Device

    with Device.open() as d:
        cpu = d.is_cpu
    r = run_tool(["tools/bench_link.py", "--devices", "0,0", "--quick"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    lines = r.stdout.splitlines()
    relay = [[c.strip() for c in ln.split("|")] for ln in lines if ln.startswith("| spin |")]
    flags = [[c.strip() for c in ln.split("|")] for ln in lines if ln.startswith("| atomic | 16384 |")]
    assert len(relay) == 1 and len(flags) == 1, r.stdout[-2000:]
    assert relay[0][4] == "[0, 0]"  # wrong elements (dev0, dev1)
    wrong, gave_up = _json.loads(flags[0][6]), _json.loads(flags[0][7])
    assert len(wrong) == 2 and len(gave_up) == 2 and all(isinstance(v, int) for v in wrong + gave_up)
    if cpu:
        assert wrong == [0, 0] and gave_up == [0, 0]


def test_tensor_split_tools_quick(tmp_path):
    """bench_multigpu's ``row`` configuration (crossed bytes: both partials of 8 all-reduces of
    a 4-layer tiny model: 8 prompt tokens x 256 f32 x 2 x 8 = 128 KiB, one decode token 16 KiB)
    and diag_tensor_split, on two hubs of the one device."""
    r = run_tool(["tools/bench_multigpu.py", "--quick", "--shape", "tiny", "--splits", "row",
                  "--dir", str(tmp_path / "m")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    row = [ln for ln in r.stdout.splitlines() if ln.startswith("| `row` |")]
    assert row, r.stdout[-2000:]
    cells = [c.strip() for c in row[0].split("|")]
    assert float(cells[3]) > 0 and float(cells[4]) > 0
    assert cells[5] == "0.12" and cells[6] == "0.02" and cells[7] == "8 / 8"
    r = run_tool(["tools/diag_tensor_split.py", "--devices", "0,0", "--shape", "tiny", "-p", "8", "--steps", "1"],
                 tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| spin") or ln.startswith("| block")]
    assert len(rows) == 4 and all(float(ln.split("|")[5]) < 1e-3 for ln in rows), r.stdout[-2000:]


def test_build_tool_shaders(tmp_path):
    """tools/build_tool_shaders.py builds experiment kernels (here two) into a directory of
    their own with a manifest, incrementally; --check says whether they are built and fresh."""
    import json

    out = tmp_path / "tool-spv"
    only = ["--only", "^(wait_flag|probe_read_u2)$", "--out", str(out)]
    r = run_tool(["tools/build_tool_shaders.py", "--check", *only], tmp_path)
    assert r.returncode == 1 and "declared but not built" in r.stdout
    r = run_tool(["tools/build_tool_shaders.py", *only], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(json.loads((out / "manifest.json").read_text())["variants"]) == {"wait_flag", "probe_read_u2"}
    assert (out / "wait_flag.spv").stat().st_size > 0
    r = run_tool(["tools/build_tool_shaders.py", *only], tmp_path)
    assert r.returncode == 0 and "building" not in r.stdout + r.stderr  # fresh: nothing rebuilt
    r = run_tool(["tools/build_tool_shaders.py", "--check", *only], tmp_path)
    assert r.returncode == 0 and "2 of 2" in r.stdout


def test_warm_pipelines(tmp_path):
    """tools/warm_pipelines.py creates the usable pipelines it is asked for and writes the
    pipeline cache (the device_run.sh `warm` target, before tests on a fresh GPU machine)."""
    r = run_tool(["tools/warm_pipelines.py", "--prefix", "get_rows_,dequant_rows_"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "created" in r.stdout and " of " in r.stdout and "FAILED" not in r.stdout
    made = int(r.stdout.split("created ", 1)[1].split(" ", 1)[0])
    assert made >= 19  # get_rows for 11 types, dequant_rows for the 8 quantized ones
    assert list((tmp_path / "cache").glob("pipelines-*.bin"))


def test_bench_multigpu_bf16_partials_and_auto_quick(tmp_path):
    """bench_multigpu's ``tensor:1,1:bf16`` (half the bytes of f32 partials: 8 prompt tokens x 256
    x 2 bytes x 2 partials x 8 all-reduces = 64 KiB, a decode token 8 KiB) and ``auto`` (what the
    cost model picks at load, the candidates in its row), on two hubs of the one device."""
    r = run_tool(["tools/bench_multigpu.py", "--quick", "--shape", "tiny", "--splits", "tensor:1,1:bf16;auto",
                  "--dir", str(tmp_path / "m")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")] for ln in r.stdout.splitlines()
            if ln.startswith("| `")}
    c = rows["`tensor:1,1:bf16`"]
    assert float(c[3]) > 0 and float(c[4]) > 0 and c[5] == "0.06" and c[6] == "0.01" and c[7] == "8 / 8"
    c = rows["`auto`"]
    assert float(c[3]) > 0 and float(c[4]) > 0
    assert "'peer': 'auto over 3 candidates (one hub " in r.stdout
