"""The shader build step: shipped SPIR-V matches its sources and passes spirv-val."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from vkxsplit import shaders


def test_every_source_matches_its_spirv():
    problems = shaders.check_manifest()
    assert not problems, "stale shaders (run `vkxsplit build-shaders`):\n" + "\n".join(problems)


def test_every_module_passes_spirv_val():
    if shaders._tool("spirv-val") is None:
        pytest.skip("spirv-val is not installed here (tools/setup.sh installs it)")
    man = shaders.load_manifest()["variants"]
    assert man, "no shaders shipped"
    for name, meta in man.items():
        shaders.spirv_validate(shaders.SPV_DIR / f"{name}.spv", meta["target_env"])


def test_manifest_records_compiler_and_defines():
    man = shaders.load_manifest()
    assert man["compilers"]["glslc"] != "missing"
    v = shaders.all_variants()["convert_f32_bf16"]
    e = man["variants"]["convert_f32_bf16"]
    assert e["defines"] == v.defines and e["source"] == "convert.comp"


def test_changed_source_is_detected(tmp_path, monkeypatch):
    src = tmp_path / "shaders"
    shutil.copytree(shaders.source_dir(), src)
    monkeypatch.setenv("VKXSPLIT_SHADER_SRC", str(src))
    assert not shaders.check_manifest()
    # an edit to an included file must invalidate every variant that includes it
    with open(src / "common.glsl", "a") as f:
        f.write("\n// edited\n")
    stale = shaders.check_manifest()
    assert any(p.startswith("convert_f32_bf16:") for p in stale)


def test_cli_check_reports_in_sync():
    r = subprocess.run([sys.executable, "-m", "vkxsplit", "build-shaders", "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "in sync" in r.stdout


def test_manifest_is_valid_json_with_hashes():
    data = json.loads(shaders.MANIFEST.read_text())
    for name, e in data["variants"].items():
        assert len(e["source_sha256"]) == 64 and len(e["spv_sha256"]) == 64, name


def test_only_what_default_paths_choose_ships():
    """No experiment kernel ships: probes, flag waits, emulated and decode-check variants, the
    wide mat-vec and the sweep shapes are built on demand (tools/kernels.py); every name
    declared there that ships is one a default path takes."""
    import kernels

    shipped = shaders.shipped()
    assert not [n for n in shipped if n.startswith(("probe_", "wait_flag", "link_flag", "cm2_decode_check"))
                or "_emu" in n or "_wide_" in n]
    assert not set(kernels.tool_variants()) & set(shipped)
    # what ships grows with the weight types the hub reads (each has its mat-vec, tiled,
    # cooperative-matrix, routed (f32 tiles and cooperative-matrix tiles) and lookup kernels),
    # not with experiments: at most 19 a type (401 modules for 11 types before the experiment
    # kernels moved out)
    from vkxsplit.ops.quant import TYPES

    assert len(shipped) <= 19 * len(TYPES)


def test_build_into_a_directory_and_load_by_name(tmp_path, device):
    """build_into compiles given variants into a directory of their own (manifest + .spv,
    incremental); add_kernel_dir makes them loadable by name after the shipped ones."""
    import numpy as np

    from vkxsplit.vk.command import Sequence
    from vkxsplit.vk.kernel import Kernel

    if not shaders.have_tool("glslc") or not shaders.have_tool("spirv-val"):
        pytest.skip("glslc / spirv-val are not installed here")
    base = shaders.all_variants()["convert_f32_f32"]
    v = shaders.Variant(**{**base.__dict__, "name": "test_extra_convert_f32_f32"})
    out = tmp_path / "extra"
    logs: list[str] = []
    man = shaders.build_into([v], out, log=logs.append)
    assert set(man["variants"]) == {v.name} and (out / f"{v.name}.spv").exists() and logs
    logs.clear()
    shaders.build_into([v], out, log=logs.append)
    assert not logs  # fresh: nothing rebuilt, the manifest left as it was
    assert not shaders.check_dir({v.name: v}, out)
    assert shaders.variant_meta(v.name) is None
    shaders.add_kernel_dir(out)
    assert shaders.variant_meta(v.name)["source"] == "convert.comp"
    assert shaders.variant_meta("convert_f32_f32") == shaders.shipped()["convert_f32_f32"]
    src = device.memory.alloc(64, "host", "src")
    dst = device.memory.alloc(64, "host", "dst")
    try:
        src.numpy(np.float32)[:] = np.arange(16, dtype=np.float32)
        dst.numpy(np.float32)[:] = np.nan
        k = Kernel.get(device, v.name)
        s = Sequence(device, "extra")
        s.dispatch(k, [src, dst], (16, 0, 0), 1)  # n, src_offset, dst_offset
        s.run()
        s.close()
        assert np.array_equal(dst.numpy(np.float32), np.arange(16, dtype=np.float32))
        k.close()
    finally:
        src.close()
        dst.close()
