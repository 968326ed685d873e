"""`vkxsplit info`: its report agrees with vulkaninfo, fits 80 columns, reports surfaces under
Xvfb, and fails cleanly (message + hint, no traceback) without a loader, driver or device.

The command runs in a subprocess through ``vkxsplit.cli.main`` with only the info module
registered, so that subcommands under construction elsewhere cannot break these tests.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ("import sys; from vkxsplit import cli; cli.COMMAND_MODULES = ('vkxsplit.info',); "
          "sys.exit(cli.main(sys.argv[1:]))")
INTEL_ICD = Path("/usr/share/vulkan/icd.d/intel_icd.x86_64.json")


def run_info(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    for k, v in list(e.items()):
        if v is None:
            del e[k]
    return subprocess.run([sys.executable, "-c", RUNNER, "info", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report() -> dict:
    r = run_info("--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ------------------------------------------------------------------------------------------
# JSON vs vulkaninfo


def _vulkaninfo_json(tmp: Path, gpu: int) -> dict:
    r = subprocess.run(["vulkaninfo", f"--json={gpu}", "-o", f"gpu{gpu}.json"], cwd=tmp,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads((tmp / f"gpu{gpu}.json").read_text())["capabilities"]["device"]


def _vulkaninfo_memory(text: str) -> dict[int, dict]:
    """Per GPU index: heaps [(size, {flags})] and types [(heap, mask)] from `vulkaninfo --text`
    (its JSON profile output does not carry memory properties)."""
    out = {}
    chunks = re.split(r"^GPU(\d+):\s*$", text, flags=re.M)
    for i in range(1, len(chunks), 2):
        body = chunks[i + 1]
        if "VkPhysicalDeviceMemoryProperties:" not in body:
            continue
        mem = body.split("VkPhysicalDeviceMemoryProperties:", 1)[1].split("VkPhysicalDeviceFeatures:", 1)[0]
        heaps_part, _, types_part = mem.partition("memoryTypes:")
        heaps = []
        for block in re.split(r"memoryHeaps\[\d+\]:", heaps_part)[1:]:
            size = int(re.search(r"size\s*=\s*(\d+)", block).group(1))
            heaps.append((size, set(re.findall(r"MEMORY_HEAP_\w+_BIT", block))))
        types = []
        for block in re.split(r"memoryTypes\[\d+\]:", types_part)[1:]:
            heap = int(re.search(r"heapIndex\s*=\s*(\d+)", block).group(1))
            mask = int(re.search(r"propertyFlags\s*=\s*(0x[0-9a-fA-F]+)", block).group(1), 16)
            types.append((heap, mask))
        out[int(chunks[i])] = {"heaps": heaps, "types": types}
    return out


@pytest.mark.skipif(shutil.which("vulkaninfo") is None, reason="vulkaninfo (vulkan-tools) is not installed")
def test_json_agrees_with_vulkaninfo(report, tmp_path):
    assert report["schema_version"] == 1
    assert report["devices"], "no devices in the report"
    text = subprocess.run(["vulkaninfo", "--text"], capture_output=True, text=True, timeout=60).stdout
    memory = _vulkaninfo_memory(text)
    for d in report["devices"]:
        vi = _vulkaninfo_json(tmp_path, d["index"])
        props = vi["properties"]["VkPhysicalDeviceProperties"]
        assert d["name"] == props["deviceName"]
        assert d["vendor_id"] == props["vendorID"]
        assert d["device_id"] == props["deviceID"]
        assert d["api_version"] == props["apiVersion"]
        assert d["driver_version"] == props["driverVersion"]
        assert d["type"].replace("-", "_").upper() in props["deviceType"]
        drv = vi["properties"].get("VkPhysicalDeviceDriverProperties")
        if drv:
            assert d["driver_name"] == drv["driverName"]
            assert d["driver_info"] == drv["driverInfo"]
        lim = props["limits"]
        for k in ("maxComputeSharedMemorySize", "maxPushConstantsSize", "maxStorageBufferRange"):
            assert d["limits"][k] == lim[k], k
        ssc = vi["properties"].get("VkPhysicalDeviceSubgroupSizeControlProperties")
        if ssc:
            assert d["subgroup"]["min_size"] == ssc["minSubgroupSize"]
            assert d["subgroup"]["max_size"] == ssc["maxSubgroupSize"]
        # queue families: flags, counts, timestamp bits, in order
        fams = [q["VkQueueFamilyProperties"] for q in vi["queueFamiliesProperties"]]
        assert len(d["queue_families"]) == len(fams)
        for mine, theirs in zip(d["queue_families"], fams):
            assert set(mine["flags"]) == set(theirs["queueFlags"]), (mine, theirs)
            assert mine["count"] == theirs["queueCount"]
            assert mine["timestamp_valid_bits"] == theirs["timestampValidBits"]
        # device extensions with their spec versions
        assert {e["name"]: e["spec_version"] for e in d["extensions"]} == vi["extensions"]
        # memory heaps (sizes, flags) and types
        m = memory[d["index"]]
        assert [(h["size"], {f[3:] for f in h["flags"]}) for h in d["memory_heaps"]] == m["heaps"]
        assert [(t["heap"], t["flags_mask"]) for t in d["memory_types"]] == m["types"]


def test_json_shape(report):
    inst = report["instance"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", inst["api_version_str"])
    assert isinstance(inst["layers"], list) and isinstance(inst["extensions"], list)
    assert report["hub_device"] in [d["index"] for d in report["devices"]]
    assert report["validation_messages"] == []
    names = [b["name"] for b in report["backends"]]
    assert names[0] == "cpu" and "npu-emu" in names and "cuda" in names and "hip" in names
    for d in report["devices"]:
        interop = d["interop"]
        assert set(interop["memory"]) == {"dma_buf", "opaque_fd", "host_allocation"}
        assert set(interop["semaphores"]["opaque_fd"]) == {"binary", "timeline"}
        assert set(interop["fences"]) == {"opaque_fd", "sync_fd"}
        k = d["kernels"]
        assert k["plain"]["total"] + k["coopmat"]["total"] == report["shaders"]["manifest_variants"]
        rows = {r["backend"]: r for r in d["attach_matrix"]}
        assert "cpu" in rows and "npu-emu" in rows
        for r in rows.values():
            assert r["memory"] in ("dma_buf", "opaque_fd", "host_allocation", "staged_copy")
            assert r["event"] in ("imported_timeline", "sync_file", "host_bridge")
        cm = d["cooperative_matrix"]
        if cm["supported"]:
            assert cm["shapes"], "cooperative matrix supported but no shapes listed"


def test_multi_gpu_report_rules(report):
    """Stages need host-allocation import (the hidden state crosses through host pages); a pair
    of devices is linked only when both can; one GPU twice is marked as such."""
    from vkxsplit.info import multi_gpu_report

    def dev(i, uuid, ext=True, imp=True):
        return {"index": i, "name": f"gpu{i}", "device_uuid": uuid, "driver_uuid": "d",
                "interop": {"memory": {"host_allocation": {"extension_present": ext, "importable": imp}}}}

    r = multi_gpu_report([dev(0, "a"), dev(1, "b"), dev(2, "a", ext=False)])
    assert [x["can_host_stage"] for x in r["stages"]] == [True, True, False]
    assert r["stages"][2]["reason"] == "no VK_EXT_external_memory_host"
    links = {(ln["from"], ln["to"]): ln for ln in r["links"]}
    assert set(links) == {(0, 1), (0, 2), (1, 2)}
    assert links[(0, 1)]["memory"] == "host_allocation" and not links[(0, 1)]["same_gpu"]
    assert links[(0, 2)]["memory"] is None and "GPU2" in links[(0, 2)]["reason"] and links[(0, 2)]["same_gpu"]
    # this machine's report (lavapipe: host allocations importable)
    mg = report["multi_gpu"]
    assert [x["index"] for x in mg["stages"]] == [d["index"] for d in report["devices"]]
    assert all(x["can_host_stage"] == d["interop"]["memory"]["host_allocation"]["importable"]
               for x, d in zip(mg["stages"], report["devices"]))


# ------------------------------------------------------------------------------------------
# text


def test_text_fits_80_columns():
    r = run_info()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    too_long = [ln for ln in lines if len(ln) > 80]
    assert not too_long, "\n".join(too_long)
    for heading in ("Instance", "Shaders", "Backends"):
        assert heading in lines
    assert any(ln.startswith("GPU0: ") for ln in lines)
    for part in ("Memory heaps", "Queue families", "Interop", "Kernels", "Attach matrix"):
        assert any(ln.strip().startswith(part) for ln in lines), part
    assert "Traceback" not in r.stderr


def test_device_option(report):
    r = run_info("--json", "--device", "0")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert [d["index"] for d in j["devices"]] == [0] and j["hub_device"] == 0
    bad = run_info("--device", str(report["device_count"] + 5))
    assert bad.returncode == 3
    assert "does not exist" in bad.stderr and "hint:" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------------
# --surface


def test_surface_without_display():
    r = run_info("--surface", "--json", env={"DISPLAY": None, "WAYLAND_DISPLAY": None})
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["surface"]
    assert s["requested"] and not s["available"]
    assert s["reason"]
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb is not installed")
def test_surface_under_xvfb(tmp_path):
    num = next(n for n in random.sample(range(200, 60000), 50) if not Path(f"/tmp/.X11-unix/X{n}").exists()
               and not Path(f"/tmp/.X{n}-lock").exists())
    log = open(tmp_path / "xvfb.log", "w")
    xvfb = subprocess.Popen(["Xvfb", f":{num}", "-nolisten", "tcp", "-screen", "0", "640x480x24"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        sock = Path(f"/tmp/.X11-unix/X{num}")
        deadline = time.monotonic() + 10
        while not sock.exists():
            if xvfb.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"Xvfb :{num} did not start: {(tmp_path / 'xvfb.log').read_text()[-500:]}")
            time.sleep(0.05)
        r = run_info("--surface", "--json", env={"DISPLAY": f":{num}", "WAYLAND_DISPLAY": None})
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        s = j["surface"]
        assert s["available"], s
        assert "VK_KHR_surface" in s["instance_extensions"]
        assert j["validation_messages"] == []
        for d in j["devices"]:
            ds = d["surface"]
            assert len(ds["presentation_support"]) == len(d["queue_families"])
            if any(ds["presentation_support"]):
                assert ds["formats"] and "VK_PRESENT_MODE_FIFO_KHR" in ds["present_modes"]
        t = run_info("--surface", env={"DISPLAY": f":{num}", "WAYLAND_DISPLAY": None})
        assert t.returncode == 0 and "present modes" in t.stdout
        assert max(len(ln) for ln in t.stdout.splitlines()) <= 80
    finally:
        xvfb.terminate()
        try:
            xvfb.wait(timeout=10)
        except subprocess.TimeoutExpired:
            xvfb.kill()
            xvfb.wait()
        log.close()


# ------------------------------------------------------------------------------------------
# error paths: message and hint, non-zero exit, no traceback


def _assert_clean_failure(r: subprocess.CompletedProcess, words: str) -> None:
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    # (loader messages may come first when the validation layer is on)
    assert any(ln.startswith("vkxsplit: error: ") for ln in r.stderr.splitlines()), r.stderr
    assert words in r.stderr, r.stderr
    assert "\n  hint: " in r.stderr, r.stderr
    assert r.stdout == ""


def test_no_icd():
    r = run_info(env={"VK_DRIVER_FILES": "/nonexistent.json", "VK_ICD_FILENAMES": None})
    _assert_clean_failure(r, "no Vulkan driver (ICD)")
    assert "/nonexistent.json (file missing)" in r.stderr


def test_broken_icd(tmp_path):
    icd = tmp_path / "broken_icd.json"
    icd.write_text(json.dumps({"file_format_version": "1.0.0",
                               "ICD": {"library_path": "/nonexistent/libvulkan_broken.so",
                                       "api_version": "1.3.0"}}))
    r = run_info(env={"VK_DRIVER_FILES": str(icd), "VK_ICD_FILENAMES": None})
    _assert_clean_failure(r, "no Vulkan driver (ICD)")
    assert "libvulkan_broken.so missing" in r.stderr


@pytest.mark.skipif(not INTEL_ICD.exists(), reason="needs a driver without hardware (Mesa's intel ICD)")
def test_no_device():
    r = run_info(env={"VK_DRIVER_FILES": str(INTEL_ICD), "VK_ICD_FILENAMES": None})
    _assert_clean_failure(r, "no usable physical device")
    assert INTEL_ICD.name in r.stderr


def test_no_loader(tmp_path):
    fake = tmp_path / "vulkan"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise OSError('Cannot find Vulkan SDK version. Please ensure that it is installed and that "
        "the <sdk_root>/<version>/lib/ folder is in the library path')\n")
    pp = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    r = run_info(env={"PYTHONPATH": pp})
    _assert_clean_failure(r, "no Vulkan loader")


def test_import_does_not_load_vulkan():
    code = "import sys, vkxsplit.info; assert 'vulkan' not in sys.modules, 'vulkan imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------
# attach matrix rules, backends, kernels (in process)


def _interop(dma=(False, False, False), opaque=(True, True, True), host=(True, False, True),
             timeline_opaque=(False, False), binary_sync=(False, False)) -> dict:
    def mem(ext, t):
        return {"extension": ext, "extension_present": t[0], "exportable": t[1], "importable": t[2],
                "dedicated_only": False}

    def sem(t):
        return {"exportable": t[0], "importable": t[1]}

    no = (False, False)
    return {"memory": {"dma_buf": mem("VK_EXT_external_memory_dma_buf", dma),
                       "opaque_fd": mem("VK_KHR_external_memory_fd", opaque),
                       "host_allocation": mem("VK_EXT_external_memory_host", host)},
            "semaphores": {"opaque_fd": {"binary": sem(no), "timeline": sem(timeline_opaque)},
                           "sync_fd": {"binary": sem(binary_sync), "timeline": sem(no)}},
            "fences": {"opaque_fd": sem(no), "sync_fd": sem(no)},
            "min_imported_host_pointer_alignment": 4096}


HUB_UUID = bytes(range(16))
HUB = SimpleNamespace(name="hub", device_uuid=HUB_UUID)


def _uuid(b: bytes) -> str:
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def test_attach_matrix_rules():
    from vkxsplit.info import attach_matrix

    cuda_same = {"name": "cuda", "kind": "cuda", "available": True,
                 "devices": [{"index": 0, "name": "x", "uuid": _uuid(HUB_UUID)}]}
    cuda_other = dict(cuda_same, devices=[{"index": 0, "name": "x", "uuid": _uuid(bytes(16))}])
    backends = [{"name": "cpu", "kind": "cpu", "available": True}, cuda_same,
                {"name": "hip", "kind": "hip", "available": False},
                {"name": "npu:accel0", "kind": "npu", "available": True},
                {"name": "npu-emu", "kind": "npu-emu", "available": True}]

    # an NVIDIA-like hub: opaque fd + timeline export, host import, no dma-buf, no sync fd
    rows = {r["backend"]: r for r in attach_matrix(HUB, backends, _interop(timeline_opaque=(True, True)))}
    assert "hip" not in rows  # unavailable backends get no row
    assert (rows["cpu"]["memory"], rows["cpu"]["event"]) == ("host_allocation", "host_bridge")
    assert (rows["cuda"]["memory"], rows["cuda"]["event"]) == ("opaque_fd", "imported_timeline")
    assert rows["cuda"]["memory_why_not"] == ["dma-buf: VK_EXT_external_memory_dma_buf missing"]
    # the emulator reports completion over its socket, as vkxsplit/backends/npu_emu.py does
    assert (rows["npu-emu"]["memory"], rows["npu-emu"]["event"]) == ("host_allocation", "host_bridge")
    assert (rows["npu:accel0"]["memory"], rows["npu:accel0"]["event"]) == ("staged_copy", "host_bridge")
    assert any("sync" in w for w in rows["npu:accel0"]["event_why_not"])

    # CUDA device is not the hub: opaque handles cannot cross devices
    r = attach_matrix(HUB, [cuda_other], _interop(timeline_opaque=(True, True)))[0]
    assert (r["memory"], r["event"]) == ("staged_copy", "host_bridge")
    assert any("UUIDs differ" in w for w in r["memory_why_not"] + r["event_why_not"])

    # no host import: cpu takes opaque fd only when an mmap of it was checked
    no_host = _interop(host=(False, False, False))
    r = attach_matrix(HUB, backends[:1], no_host)[0]
    assert r["memory"] == "staged_copy"
    assert r["memory_why_not"] == ["host allocation: VK_EXT_external_memory_host missing",
                                   "opaque fd: mmap of exported fds not checked"]
    assert attach_matrix(HUB, backends[:1], no_host, opaque_fd_mappable=True)[0]["memory"] == "opaque_fd"
    r = attach_matrix(HUB, backends[:1], no_host, opaque_fd_mappable=False, opaque_fd_reason="ENODEV")[0]
    assert r["memory"] == "staged_copy" and "ENODEV" in r["memory_why_not"][1]

    # a dma-buf hub with sync fds: cuda and NPUs take dma-buf, NPUs sync_file
    rich = _interop(dma=(True, True, True), binary_sync=(True, True))
    rows = {r["backend"]: r for r in attach_matrix(HUB, backends, rich)}
    assert rows["cuda"]["memory"] == "dma_buf"
    assert (rows["npu:accel0"]["memory"], rows["npu:accel0"]["event"]) == ("dma_buf", "sync_file")
    assert rows["cuda"]["event"] == "host_bridge"


def test_npu_nodes_and_matrix_on_this_hub(tmp_path):
    from vkxsplit.info import attach_matrix, probe_backends
    from vkxsplit.vk.instance import Instance

    (tmp_path / "dev" / "accel").mkdir(parents=True)
    (tmp_path / "dev" / "accel" / "accel0").touch()
    drv = tmp_path / "sys" / "bus" / "pci" / "drivers" / "amdxdna"
    drv.mkdir(parents=True)
    dev_dir = tmp_path / "sys" / "class" / "accel" / "accel0" / "device"
    dev_dir.mkdir(parents=True)
    (dev_dir / "driver").symlink_to(drv)
    backends = probe_backends(str(tmp_path / "dev"), str(tmp_path / "sys"))
    npu = [b for b in backends if b["kind"] == "npu"]
    assert len(npu) == 1 and npu[0]["name"] == "npu:accel0" and npu[0]["driver"] == "amdxdna"
    assert npu[0]["available"]
    with Instance(validation=False) as inst:
        phys = inst.select()
        rows = {r["backend"]: r for r in attach_matrix(phys, backends)}
        if not phys.has("VK_EXT_external_memory_dma_buf"):
            assert rows["npu:accel0"]["memory"] == "staged_copy"
            assert "dma-buf: VK_EXT_external_memory_dma_buf missing" in rows["npu:accel0"]["memory_why_not"]
        assert rows["cpu"]["memory"] in ("host_allocation", "opaque_fd", "staged_copy")


def test_kernel_report():
    from vkxsplit.info import kernel_report

    p = SimpleNamespace(features={"storageBuffer16BitAccess": True, "cooperativeMatrix": False,
                                  "subgroupSizeControl": True},
                        subgroup_size=8, min_subgroup_size=8, max_subgroup_size=16)
    variants = {"a": {"requires": ["storageBuffer16BitAccess"], "subgroup_size": 0},
                "b": {"requires": ["cooperativeMatrix"], "subgroup_size": 32},
                "c": {"requires": [], "subgroup_size": 16},
                "d": {"requires": ["shaderInt8"], "subgroup_size": 0}}
    k = kernel_report(p, variants)
    assert k["plain"] == {"total": 3, "usable": 2} and k["coopmat"] == {"total": 1, "usable": 0}
    assert k["usable"] == ["a", "c"]
    missing = {u["name"]: u["missing"] for u in k["unusable"]}
    assert missing["d"] == ["shaderInt8"]
    assert missing["b"][0] == "cooperativeMatrix" and "subgroup size 32" in missing["b"][1]
    assert k["subgroup_sizes"] == [{"size": 16, "variants": 1, "supported": True},
                                   {"size": 32, "variants": 1, "supported": False}]


def test_opaque_fd_mmap_probe(device):
    from vkxsplit.info import probe_opaque_fd_mappable
    from vkxsplit.vk.interop import buffer_handle_support
    from vkxsplit.vk.memory import HANDLE_OPAQUE_FD

    if "VK_KHR_external_memory_fd" not in device.extensions or \
            not buffer_handle_support(device.physical, HANDLE_OPAQUE_FD)["exportable"]:
        pytest.skip("the hub cannot export opaque fds")
    ok, why = probe_opaque_fd_mappable(device)
    assert isinstance(ok, bool) and why
    if device.physical.is_lavapipe:
        # lavapipe's opaque fds are memfds, but the memory starts after a driver header (Mesa
        # 22.3: at 4096), so a plain mmap of the fd is not the buffer: not usable as-is.
        assert not ok and "file offset" in why, why
    # the probe wrote nothing through the fd: the device still works
    buf = device.memory.alloc(256, "host")
    buf.write(bytes(range(256)))
    assert buf.read().tobytes() == bytes(range(256))
    buf.close()


def test_decode_q8_1_paths_are_reported(report):
    """Which decode mat-vecs read x as q8_1: the JSON names shipped integer-dot-product
    variants exactly where the device has the integer dot product feature (as the report
    lists it; Q4_K too, on CPUs and GPUs; Q6_K on CPUs), all usable there; the kill switch empties
    it and the text says so."""
    from vkxsplit.shaders import all_variants

    for d in report["devices"]:
        dq = d["kernels"]["decode_q8_1"]
        if not d["features"].get("shaderIntegerDotProduct"):
            assert dq == {}
            continue
        want = {"q4_0", "q4_1", "q8_0", "q4_k"} | ({"q6_k"} if d["type"] == "cpu" else set())
        assert set(dq) == want  # (Q4_K on GPUs too since session 4; Q6_K on CPUs since session 10)
        for t, v in dq.items():
            assert v in all_variants() and v.startswith(f"mul_mat_vecq_{t}_q8_1_m1_") and v in d["kernels"]["usable"]
    off = run_info("--json", env={"VKXSPLIT_DISABLE": "intdot"})
    assert all(d["kernels"]["decode_q8_1"] == {} for d in json.loads(off.stdout)["devices"])
    text = run_info(env={"VKXSPLIT_DISABLE": "intdot"}).stdout
    assert "decode x as q8_1" in text and "VKXSPLIT_DISABLE=intdot" in text


def test_prefill_path_is_reported(report, monkeypatch):
    """The mat-mat path of products over 8 rows: this machine's devices as record_mul_mat
    decides (coopmat availability); a fake coopmat2 device gets mul_mat_cm2 with dq16 from
    DQ16_MIN_M, which the kill switches take away."""
    from vkxsplit.info import prefill_report
    from vkxsplit.ops import choose
    from vkxsplit.ops import mul_mat as mm
    from vkxsplit.vk import instance as vki
    from vkxsplit.vk.device import COOPMAT2_NEEDS

    for d in report["devices"]:
        pf = d["kernels"]["prefill"]
        assert pf["path"] in ("mul_mat_cm2", "mul_mat_coopmat", "tiled")
        assert pf["dq16"] == (pf["path"] == "mul_mat_cm2")
        if d["type"] == "cpu":  # lavapipe: no cooperative matrices
            assert pf == {"path": "tiled", "dq16": False, "dq16_min_m": None}
    feats = {f: True for f in (*mm._CM2_REQUIRES, *COOPMAT2_NEEDS, "cooperativeMatrix")}
    flex = [vki.CoopMatFlex(16, 16, 16, 0, 0, 1, 1, False, 2, n) for n in (128, 256)]
    p = SimpleNamespace(features=feats, name="fake", coopmat2_flex=flex,
                        has=lambda e: e == "VK_NV_cooperative_matrix2")
    assert prefill_report(p) == {"path": "mul_mat_cm2", "dq16": True, "dq16_min_m": choose.DQ16_MIN_M}
    monkeypatch.setenv("VKXSPLIT_DISABLE", "dq16")
    assert prefill_report(p)["dq16"] is False
    p.has = lambda e: False  # no extension: no cooperative matrix shapes either here
    p.coopmat_shapes, p.min_subgroup_size, p.max_subgroup_size, p.limits = [], 32, 32, {}
    assert prefill_report(p)["path"] == "tiled"
