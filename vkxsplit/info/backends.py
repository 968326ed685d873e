"""The backends ``vkxsplit info`` finds: cpu (ggml's CPU kernels and the CPU features they use),
CUDA and HIP devices (through their Python bindings, only when installed), NPU device nodes,
the NPU emulator and the vulkan peer, and the device nodes the attach layer can use (dma-heaps,
udmabuf, render and accel nodes). Nothing heavy is imported until a probe runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .names import _uuid


def _probe_cuda() -> dict[str, Any]:
    import importlib.util

    b: dict[str, Any] = {"name": "cuda", "kind": "cuda", "available": False, "devices": []}
    try:
        spec = importlib.util.find_spec("cuda.bindings.runtime")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        b["detail"] = "cuda-bindings not installed (pip install cuda-bindings)"
        return b
    try:
        from cuda.bindings import runtime as rt  # imported only when installed
    except Exception as exc:  # a broken install must not break the report
        b["detail"] = f"cuda-bindings does not import: {exc}"
        return b

    def err_name(err: Any) -> str:
        return getattr(err, "name", str(err))

    try:
        err, count = rt.cudaGetDeviceCount()
        if int(err) != 0:
            b["detail"] = f"cudaGetDeviceCount: {err_name(err)}"
            return b
        for i in range(count):
            dev: dict[str, Any] = {"index": i, "name": "", "uuid": None}
            try:
                e2, prop = rt.cudaGetDeviceProperties(i)
                if int(e2) == 0:
                    name = prop.name
                    dev["name"] = (name.split(b"\0", 1)[0].decode(errors="replace")
                                   if isinstance(name, bytes) else str(name))
                    dev["uuid"] = _uuid(bytes(prop.uuid.bytes)[:16])
            except Exception:
                pass
            b["devices"].append(dev)
    except Exception as exc:
        b["detail"] = f"cudaGetDeviceCount failed: {exc}"
        return b
    b["available"] = count > 0
    b["detail"] = f"{count} CUDA device(s)" if count else "cuda-bindings installed but no CUDA device"
    return b


def _probe_hip() -> dict[str, Any]:
    import importlib.util

    b: dict[str, Any] = {"name": "hip", "kind": "hip", "available": False, "devices": []}
    try:
        spec = importlib.util.find_spec("hip")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        b["detail"] = "hip-python not installed (package 'hip')"
        return b
    b["available"] = True
    b["detail"] = "hip-python importable"
    try:
        from hip import hip as hiprt  # imported only when installed

        err, count = hiprt.hipGetDeviceCount()
        if int(err) != 0:
            b["available"] = False
            b["detail"] = f"hipGetDeviceCount: {getattr(err, 'name', err)}"
        else:
            b["devices"] = [{"index": i, "name": "", "uuid": None} for i in range(count)]
            b["available"] = count > 0
            b["detail"] = f"{count} HIP device(s)" if count else "hip-python installed but no HIP device"
    except Exception as exc:  # device count unknown: importable is what counts
        b["detail"] = f"hip-python importable (device count unknown: {exc})"
    return b


def _probe_npus(dev_root: str = "/dev", sys_root: str = "/sys") -> list[dict[str, Any]]:
    accel = Path(dev_root) / "accel"
    nodes = sorted(accel.glob("accel*")) if accel.is_dir() else []
    if not nodes:
        return [{"name": "npu", "kind": "npu", "available": False, "node": None, "driver": None,
                 "detail": f"no {accel}/accel* device nodes"}]
    out = []
    for node in nodes:
        drv_link = Path(sys_root) / "class" / "accel" / node.name / "device" / "driver"
        try:
            driver = os.path.basename(os.readlink(drv_link))
        except OSError:
            driver = None
        ok = os.access(node, os.R_OK | os.W_OK)
        out.append({"name": f"npu:{node.name}", "kind": "npu", "available": True, "node": str(node),
                    "driver": driver,
                    "detail": f"{node} (driver {driver or 'unknown'})"
                    + ("" if ok else "; no read/write permission")})
    return out


def _probe_cpu() -> dict[str, Any]:
    """The cpu backend: ggml's CPU kernels from libggml-python (its version, and the CPU features
    ggml detected: what its quantized dot products use)."""
    from ..backends import ggml_cpu

    out: dict[str, Any] = {"name": "cpu", "kind": "cpu", "available": False}
    try:
        g = ggml_cpu.load()
    except Exception as exc:  # a missing package is a reason to report
        out["detail"] = f"{exc}" + (f" ({exc.hint})" if getattr(exc, "hint", "") else "")
        return out
    from ..ops.quant import TYPES

    cores = ggml_cpu.physical_cores()
    feats = g.features()
    # the weight types the cpu backend multiplies by copies in one of ggml-cpu's extra buffer
    # types here (AMX where the build and the CPU have it, else CPU_REPACK), for a weight of 256
    # columns and 32 rows
    repacked: dict[str, list[str]] = {}
    for n, t in TYPES.items():
        kind = g.repacks(t.id, 256, 32) if t.quantized else None
        if kind is not None:
            repacked.setdefault(kind, []).append(n)
    out.update(available=True, ggml={"version": g.version, "commit": g.commit, "package": g.package,
                                     "package_version": g.package_version, "libdir": g.libdir, "features": feats,
                                     "physical_cores": cores, "repacked_types": repacked},
               detail=f"ggml {g.version} ({g.package} {g.package_version}), {cores} physical cores "
                      f"({os.cpu_count() or 1} logical); ggml CPU features: "
                      + (" ".join(f for f, on in feats.items() if on) or "none")
                      + "; repacked weight layouts: "
                      + ("; ".join(f"{k} {' '.join(v)}" for k, v in repacked.items()) or "none"))
    return out


def probe_backends(dev_root: str = "/dev", sys_root: str = "/sys") -> list[dict[str, Any]]:
    """Every backend kind, found or not (``available``), without eager heavy imports."""
    cpu = _probe_cpu()
    emu = {"name": "npu-emu", "kind": "npu-emu", "available": True,
           "detail": "vkxsplit's NPU emulator process backend (always available)"}
    return [cpu, _probe_cuda(), _probe_hip(), *_probe_npus(dev_root, sys_root), emu]


def device_nodes(dev_root: str = "/dev") -> dict[str, Any]:
    d = Path(dev_root)
    heap = d / "dma_heap"
    return {
        "dma_heap": sorted(p.name for p in heap.iterdir()) if heap.is_dir() else None,
        "udmabuf": (d / "udmabuf").exists(),
        "dri_render": sorted(p.name for p in (d / "dri").glob("renderD*")) if (d / "dri").is_dir() else [],
        "accel": sorted(p.name for p in (d / "accel").glob("accel*")) if (d / "accel").is_dir() else [],
    }
