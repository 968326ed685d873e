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
