"""The shader build step: shipped SPIR-V matches its sources and passes spirv-val."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from vkxsplit import shaders


def test_every_source_matches_its_spirv():
    problems = shaders.check_manifest()
    assert not problems, "stale shaders (run `vkxsplit build-shaders`):\n" + "\n".join(problems)


def test_every_module_passes_spirv_val():
    if shaders._tool("spirv-val") is None:
        pytest.skip("spirv-val is not installed here (tools/setup.sh installs it)")
    mods = shaders.load_manifest()["modules"]
    assert mods, "no shaders shipped"
    for name, meta in mods.items():
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
    assert data["format"] == shaders.MANIFEST_FORMAT
    for name, e in data["modules"].items():
        assert len(e["source_sha256"]) == 64 and len(e["spv_sha256"]) == 64, name
    for name, e in data["variants"].items():
        assert e["module"] in data["modules"], name
    # every module file is used by a variant, and every variant's file is there
    used = {e["module"] for e in data["variants"].values()}
    assert used == set(data["modules"]) == {p.stem for p in shaders.SPV_DIR.glob("*.spv")}


def test_matvec_shapes_share_one_module_per_type():
    """mul_mat_vec's shapes (rows, threads, units, columns) are specialization constants: the
    variants of one weight type and lane count name one module, with different spec values,
    and the resolved metadata gives the shape as the defines of a define-built variant would."""
    from vkxsplit.ops import mul_mat as mm
    from vkxsplit.ops import mul_mat_kernels as mk

    shipped = shaders.shipped()
    vec = {n: m for n, m in shipped.items() if m["source"] == "mul_mat_vec.comp"}
    mods = {m["module"] for m in vec.values()}
    assert len(vec) >= 2 * len(mods)  # most modules serve several shapes
    a, b = shipped["mul_mat_vec_q4_0_f32"], shipped["mul_mat_vec_q4_0_f32_m1"]
    assert a["module"] == b["module"] and a["spec"] != b["spec"]
    assert a["spec"]["MAXM"] == 8 and b["spec"]["MAXM"] == 1
    assert mm.vec_config("mul_mat_vec_q4_0_f32") == mm.VEC_CONFIG["q4_0"]
    assert a["defines"]["WG"] == str(mm.VEC_CONFIG["q4_0"].wg) and "WG" not in a["module_defines"]
    # the module declares the constant ids the Python table names
    code = (shaders.SPV_DIR / f"{a['module']}.spv").read_bytes()
    assert set(shaders.spec_constants(code)) == set(mk.VEC_SPEC_IDS.values())


def test_wrong_spec_values_are_refused():
    """A shape the mat-vec kernel cannot run (its final reduction takes a thread per row and
    column) is refused when the variant is made; spec values that do not match the module's
    constants, or a workgroup size that differs from its constant, are refused by Variant."""
    from vkxsplit.errors import KernelError, ShaderBuildError
    from vkxsplit.ops import mul_mat as mm

    with pytest.raises(KernelError, match="thread per row and column"):
        mm.make_vec_variant("x", "q4_0", mm.VecConfig(16, 4, 1, 2), 8)
    ok = mm.make_vec_variant("x", "q4_0", mm.VecConfig(32, 4, 1, 2), 8)
    with pytest.raises(ShaderBuildError, match="do not match"):
        shaders.Variant(**{**ok.__dict__, "spec": {"WG": 32, "NR": 4}})
    with pytest.raises(ShaderBuildError, match="workgroup size"):
        shaders.Variant(**{**ok.__dict__, "local_size": (64, 1, 1)})
    with pytest.raises(ShaderBuildError, match="32-bit"):
        shaders.Variant(**{**ok.__dict__, "spec": {**ok.spec, "NR": 2**40}})


def test_spec_ids_out_of_step_with_the_source_fail_the_build(tmp_path):
    """A constant id the GLSL does not declare fails the build with a message naming it."""
    from vkxsplit.errors import ShaderBuildError
    from vkxsplit.ops import mul_mat as mm

    if not shaders.have_tool("glslc") or not shaders.have_tool("spirv-val"):
        pytest.skip("glslc / spirv-val are not installed here")
    ok = mm.make_vec_variant("test_bad_ids", "f32", mm.VecConfig(32, 2, 1), 1)
    bad = shaders.Variant(**{**ok.__dict__, "module": "test_bad_ids_mod",
                             "spec_ids": {**ok.spec_ids, "MAXM": 9}})
    with pytest.raises(ShaderBuildError, match="constant_id 9"):
        shaders.build_into([bad], tmp_path / "bad", log=lambda *_: None)


def test_old_manifest_format_gives_a_rebuild_message(tmp_path):
    """A manifest of the format before modules (variants with their own SPIR-V) is refused with
    the command that rebuilds it, and a build into its directory rebuilds every module."""
    from vkxsplit.errors import ShaderBuildError

    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"compilers": {}, "variants": {
        "convert_f32_f32": {"source": "convert.comp", "defines": {}, "source_sha256": "0" * 64,
                            "spv_sha256": "0" * 64}}}))
    with pytest.raises(ShaderBuildError, match="build-shaders") as exc:
        shaders.load_manifest(old / "manifest.json")
    assert "format 1" in str(exc.value)
    assert shaders.check_dir({}, old)[0].endswith("rebuild every module")
    if not shaders.have_tool("glslc") or not shaders.have_tool("spirv-val"):
        return
    logs: list[str] = []
    v = shaders.all_variants()["convert_f32_f32"]
    man = shaders.build_into([v], old, log=logs.append)
    assert man["format"] == shaders.MANIFEST_FORMAT and any("older format" in m for m in logs)
    assert any(m.startswith("building 1 ") for m in logs)  # its format-1 hashes were wrong: rebuilt
    assert shaders.load_manifest(old / "manifest.json")["variants"]["convert_f32_f32"]["source"] == "convert.comp"
    # a format-1 entry that is still fresh (format 1's hash: the source closure, then the
    # variant's source, defines, layout and target as JSON) is kept, not recompiled
    legacy = {"source": v.source, "defines": v.defines, "bindings": v.bindings, "writes": list(v.writes),
              "push": v.push, "local_size": list(v.local_size), "target_env": v.target_env,
              "compiler": v.compiler, "requires": list(v.requires), "subgroup_size": v.subgroup_size}
    h = hashlib.sha256()
    for f in (shaders.source_dir() / "convert.comp", shaders.source_dir() / "common.glsl"):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(legacy, sort_keys=True).encode())
    spv = (old / "convert_f32_f32.spv").read_bytes()
    (old / "manifest.json").write_text(json.dumps({"compilers": {}, "variants": {"convert_f32_f32": {
        **legacy, "source_sha256": h.hexdigest(), "spv_sha256": hashlib.sha256(spv).hexdigest()}}}))
    logs.clear()
    shaders.build_into([v], old, log=logs.append)
    assert any("1 of 1 variants' SPIR-V still fresh" in m for m in logs), logs
    assert not any(m.startswith("building") for m in logs) and not shaders.check_dir({v.name: v}, old)


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
    # not with experiments: at most 19 SPIR-V modules a type (401 modules for 11 types before the
    # experiment kernels moved out; variants that differ by specialization values share a module)
    from vkxsplit.ops.quant import TYPES

    assert len({e.get("module", n) for n, e in shipped.items()}) <= 19 * len(TYPES)


def test_build_into_a_directory_and_load_by_name(tmp_path, device):
    """build_into compiles given variants into a directory of their own (manifest + .spv,
    incremental); add_kernel_dir makes them loadable by name after the shipped ones."""

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


def _matvec_f16(device, name: str, w16: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ W^T through the mat-vec variant ``name`` of F16 weights ``w16`` (N x K)."""
    from vkxsplit.ops import mul_mat as mm
    from vkxsplit.vk.command import Sequence

    (M, K), N = x.shape, w16.shape[0]
    wb = device.memory.alloc(w16.nbytes, "host", "w")
    xb = device.memory.alloc(4 * M * K, "host", "x")
    yb = device.memory.alloc(4 * M * N, "host", "y")
    try:
        wb.numpy(np.float16)[: w16.size] = w16.ravel()
        xb.numpy(np.float32)[: M * K] = x.ravel()
        yb.numpy(np.float32)[:] = np.nan
        s = Sequence(device, "spec")
        try:
            assert mm.record_mul_mat(s, wb, "f16", xb, yb, M, N, K, vec_variant=name) == "vec"
            s.run()
        finally:
            s.close()
        return yb.numpy(np.float32)[: M * N].reshape(M, N).copy()
    finally:
        for b in (wb, xb, yb):
            b.close()


def test_two_spec_values_of_one_module_are_two_pipelines(device):
    """Two shipped F16 mat-vec variants of one module (rows and units per workgroup as spec
    values): two pipelines from the same SPIR-V, each matching the float64 reference; the
    check fails for a wrong reference."""
    from vkxsplit.ops import mul_mat as mm
    from vkxsplit.vk.kernel import Kernel

    a = "mul_mat_vec_f16_f32_m1"
    b = mm.vec_m1_name("f16", mm.VEC_CPU_M1["f16"])
    ma, mb = shaders.variant_meta(a), shaders.variant_meta(b)
    assert ma["module"] == mb["module"] and ma["spec"] != mb["spec"]
    assert shaders.spirv(a) == shaders.spirv(b)
    ka, kb = Kernel.get(device, a), Kernel.get(device, b)
    assert ka is not kb and ka.pipeline != kb.pipeline and ka.spec != kb.spec
    rng = np.random.default_rng(29)
    N, K = 37, 264  # N not a multiple of either shape's rows; K % 8 == 0 (the unit path)
    w16 = rng.standard_normal((N, K)).astype(np.float16)
    x = rng.standard_normal((1, K)).astype(np.float32)
    ref = x.astype(np.float64) @ w16.astype(np.float64).T
    bound = (K + 4) * 2.0**-23 * (np.abs(x.astype(np.float64)) @ np.abs(w16.astype(np.float64)).T)
    for name in (a, b):
        got = _matvec_f16(device, name, w16, x)
        assert not np.isnan(got).any() and np.all(np.abs(got - ref) <= bound), name
    # the check can fail: a wrong reference (one row shifted) is far outside the bound
    assert not np.all(np.abs(got - np.roll(ref, 1, axis=1)) <= bound)


def test_workgroup_size_over_the_device_limit_is_refused(device, tmp_path):
    """A spec value that makes the workgroup larger than the device allows is refused when the
    pipeline would be made (a KernelError naming the limit), not left to the driver."""
    from vkxsplit.errors import KernelError
    from vkxsplit.ops import mul_mat as mm
    from vkxsplit.vk.kernel import Kernel

    if not shaders.have_tool("glslc") or not shaders.have_tool("spirv-val"):
        pytest.skip("glslc / spirv-val are not installed here")
    too_many = int(device.physical.limits["maxComputeWorkGroupInvocations"]) * 2
    v = mm.make_vec_variant("test_spec_wg_too_big", "f16", mm.VecConfig(too_many, 1, 1), 1)
    out = tmp_path / "big"
    shaders.build_into([v], out, log=lambda *_: None)
    shaders.add_kernel_dir(out)
    with pytest.raises(KernelError, match="over .*limits"):
        Kernel.get(device, v.name)


def test_sweep_shape_of_a_shipped_module_compiles_nothing(tmp_path):
    """An experiment shape of a shipped module (tools/kernels.py's mat-vec sweep) is spec
    values only: built with reuse_shipped, no SPIR-V is written, the entry points at the
    shipped module, and the kernel loads by name with the shipped module's code."""
    from vkxsplit.ops import mul_mat as mm

    cfg = mm.VecConfig(64, 2, 2, 2)  # a q4_0 shape that does not ship, on the shipped lane count
    name = "test_sweep_" + mm.vec_m1_name("q4_0", cfg)
    v = mm.make_vec_variant(name, "q4_0", cfg, 1)
    assert v.module_name in shaders.load_manifest()["modules"]
    out = tmp_path / "sweep"
    man = shaders.build_into([v], out, log=lambda *_: None, reuse_shipped=True)
    assert man["modules"][v.module_name]["shipped"] is True and not list(out.glob("*.spv"))
    assert not shaders.check_dir({name: v}, out)
    shaders.add_kernel_dir(out)
    assert shaders.spirv(name) == (shaders.SPV_DIR / f"{v.module_name}.spv").read_bytes()
    assert mm.vec_config(name) == cfg
    # without reuse the module is compiled into the directory (and is the same code)
    if shaders.have_tool("glslc") and shaders.have_tool("spirv-val"):
        own = tmp_path / "own"
        shaders.build_into([v], own, log=lambda *_: None)
        assert (own / f"{v.module_name}.spv").exists()


def test_variant_without_the_modules_spec_values_fails_the_build(tmp_path):
    """A variant that copies a mat-vec variant's defines but not its spec values would run the
    source's default shape: the build refuses it, naming the constants left without values."""
    from vkxsplit.errors import ShaderBuildError
    from vkxsplit.ops import mul_mat as mm

    if not shaders.have_tool("glslc") or not shaders.have_tool("spirv-val"):
        pytest.skip("glslc / spirv-val are not installed here")
    v = mm.make_vec_variant("x", "f32", mm.VecConfig(32, 2, 1), 1)
    copied = shaders.Variant(name="test_copied_defines", source=v.source, defines=v.defines, bindings=v.bindings,
                             writes=v.writes, push=v.push, local_size=v.local_size, requires=v.requires)
    with pytest.raises(ShaderBuildError, match="gives no values for"):
        shaders.build_into([copied], tmp_path / "copied", log=lambda *_: None)


def test_manifest_ident_covers_spec_values(monkeypatch):
    """Cost profiles key on manifest_ident: another spec value of the same module (the same
    SPIR-V) is another kernel, so another ident."""
    real = shaders.shipped()
    before = shaders.manifest_ident()
    name = "mul_mat_vec_q4_0_f32"
    changed = {**real, name: {**real[name], "spec": {**real[name]["spec"], "NR": real[name]["spec"]["NR"] * 2}}}
    monkeypatch.setattr(shaders, "shipped", lambda: changed)
    assert shaders.manifest_ident() != before


def test_a_build_cut_short_keeps_what_it_built(tmp_path, monkeypatch):
    """The manifest is checkpointed during a long build: when a later module fails (or the
    build is killed), the modules built before it stay listed and are not compiled again."""
    from vkxsplit.errors import ShaderBuildError

    if not shaders.have_tool("glslc") or not shaders.have_tool("spirv-val"):
        pytest.skip("glslc / spirv-val are not installed here")
    monkeypatch.setattr(shaders, "_CHECKPOINT_S", 0.0)
    base = shaders.all_variants()["convert_f32_f32"]
    good = shaders.Variant(**{**base.__dict__, "name": "a_good"})
    bad = shaders.Variant(**{**base.__dict__, "name": "b_bad", "defines": {**base.defines, "SRC_TYPE": "(1 +"}})
    out = tmp_path / "cut"
    with pytest.raises(ShaderBuildError, match="compiling b_bad failed"):
        shaders.build_into([good, bad], out, jobs=1, log=lambda *_: None)
    assert list(shaders.load_manifest(out / "manifest.json")["variants"]) == ["a_good"]
    logs: list[str] = []
    shaders.build_into([good], out, log=logs.append)
    assert not logs  # fresh from the checkpoint: nothing rebuilt
