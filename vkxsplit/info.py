"""``vkxsplit info``: what this machine can split with what (a vulkaninfo for bug reports).

Sections: the Vulkan instance (loader, layers, drivers), each physical device (properties,
memory, queues, the features that pick kernels, cooperative-matrix shapes, extensions,
external-handle interop), which shipped kernels each device runs, the backends that could
attach, and the attach matrix: per backend, the memory and event path it gets with a given
hub device and why nothing better is available. ``--json`` prints the same as one JSON
document whose schema is in docs/INFO.md (``schema_version`` changes on incompatible edits).

This module imports nothing from Vulkan at import time: the CLI imports it to build its
parser, and a machine without a Vulkan loader must still get a clean error message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import EnvironmentProblem, VkxError

SCHEMA_VERSION = 1
WIDTH = 80

# ---------------------------------------------------------------------------------------
# names for Vulkan numbers (static, so that nothing here needs the loader to be importable)

QUEUE_FLAGS = ((0x1, "VK_QUEUE_GRAPHICS_BIT"), (0x2, "VK_QUEUE_COMPUTE_BIT"),
               (0x4, "VK_QUEUE_TRANSFER_BIT"), (0x8, "VK_QUEUE_SPARSE_BINDING_BIT"),
               (0x10, "VK_QUEUE_PROTECTED_BIT"), (0x20, "VK_QUEUE_VIDEO_DECODE_BIT_KHR"),
               (0x40, "VK_QUEUE_VIDEO_ENCODE_BIT_KHR"), (0x100, "VK_QUEUE_OPTICAL_FLOW_BIT_NV"))
MEMORY_PROPERTY_FLAGS = ((0x1, "VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT"),
                         (0x2, "VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT"),
                         (0x4, "VK_MEMORY_PROPERTY_HOST_COHERENT_BIT"),
                         (0x8, "VK_MEMORY_PROPERTY_HOST_CACHED_BIT"),
                         (0x10, "VK_MEMORY_PROPERTY_LAZILY_ALLOCATED_BIT"),
                         (0x20, "VK_MEMORY_PROPERTY_PROTECTED_BIT"),
                         (0x40, "VK_MEMORY_PROPERTY_DEVICE_COHERENT_BIT_AMD"),
                         (0x80, "VK_MEMORY_PROPERTY_DEVICE_UNCACHED_BIT_AMD"),
                         (0x100, "VK_MEMORY_PROPERTY_RDMA_CAPABLE_BIT_NV"))
MEMORY_HEAP_FLAGS = ((0x1, "VK_MEMORY_HEAP_DEVICE_LOCAL_BIT"), (0x2, "VK_MEMORY_HEAP_MULTI_INSTANCE_BIT"))
SUBGROUP_OPS = ((0x1, "basic"), (0x2, "vote"), (0x4, "arithmetic"), (0x8, "ballot"), (0x10, "shuffle"),
                (0x20, "shuffle_relative"), (0x40, "clustered"), (0x80, "quad"), (0x100, "partitioned_nv"),
                (0x200, "rotate"), (0x400, "rotate_clustered"))
SHADER_STAGE_COMPUTE = 0x20

DEVICE_TYPES = {0: "other", 1: "integrated-gpu", 2: "discrete-gpu", 3: "virtual-gpu", 4: "cpu"}
VENDORS = {0x1002: "AMD", 0x1010: "ImgTec", 0x10DE: "NVIDIA", 0x13B5: "ARM", 0x5143: "Qualcomm",
           0x8086: "Intel", 0x106B: "Apple", 0x1AE0: "Google", 0x10001: "Vivante", 0x10002: "VeriSilicon",
           0x10003: "Kazan", 0x10004: "Codeplay", 0x10005: "Mesa", 0x10006: "PoCL", 0x10007: "Mobileye"}
COMPONENT_TYPES = {0: "f16", 1: "f32", 2: "f64", 3: "s8", 4: "s16", 5: "s32", 6: "s64", 7: "u8", 8: "u16",
                   9: "u32", 10: "u64", 1000141000: "bf16", 1000491000: "s8_packed", 1000491001: "u8_packed",
                   1000491002: "e4m3", 1000491003: "e5m2"}
SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}

INSTANCE_EXTENSIONS_OF_INTEREST = (
    "VK_KHR_get_physical_device_properties2", "VK_KHR_external_memory_capabilities",
    "VK_KHR_external_semaphore_capabilities", "VK_KHR_external_fence_capabilities",
    "VK_KHR_portability_enumeration", "VK_EXT_debug_utils", "VK_KHR_surface",
    "VK_KHR_xlib_surface", "VK_KHR_xcb_surface", "VK_KHR_wayland_surface", "VK_EXT_headless_surface",
)
# Beyond vkxsplit.vk.device.OPTIONAL_EXTENSIONS (what the hub enables when offered).
_MORE_DEVICE_EXTENSIONS = ("VK_NV_cooperative_matrix2", "VK_KHR_buffer_device_address",
                           "VK_KHR_shader_subgroup_rotate", "VK_EXT_memory_budget")
ENV_VARS = ("VK_DRIVER_FILES", "VK_ICD_FILENAMES", "VK_ADD_DRIVER_FILES", "VK_LAYER_PATH",
            "VK_ADD_LAYER_PATH", "VK_INSTANCE_LAYERS", "VK_LOADER_LAYERS_ENABLE",
            "VK_LOADER_LAYERS_DISABLE", "VK_LOADER_DEBUG", "VKXSPLIT_DEVICE", "VKXSPLIT_VALIDATION")
ICD_DIRS = ("/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/usr/share/vulkan/icd.d")

MEMORY_PATHS = ("dma_buf", "opaque_fd", "host_allocation", "staged_copy")
EVENT_PATHS = ("imported_timeline", "sync_file", "host_bridge")
PATH_LABELS = {"dma_buf": "dma-buf", "opaque_fd": "opaque fd", "host_allocation": "host allocation",
               "staged_copy": "staged copy", "imported_timeline": "imported timeline",
               "sync_file": "sync_file", "host_bridge": "host bridge"}


def flag_names(mask: int, table: Iterable[tuple[int, str]]) -> list[str]:
    """Names of the set bits (unknown bits as hex)."""
    out, rest = [], mask
    for bit, name in table:
        if mask & bit:
            out.append(name)
            rest &= ~bit
    bit = 1
    while rest:
        if rest & bit:
            out.append(hex(bit))
            rest &= ~bit
        bit <<= 1
    return out


def _short(vkname: str) -> str:
    for p in ("VK_QUEUE_", "VK_MEMORY_PROPERTY_", "VK_MEMORY_HEAP_"):
        if vkname.startswith(p):
            vkname = vkname[len(p):]
    return vkname.replace("_BIT", "")


def _vk_version(v: int) -> str:
    return f"{v >> 22 & 0x7F}.{v >> 12 & 0x3FF}.{v & 0xFFF}"


def driver_version_str(vendor_id: int, v: int) -> str:
    """The driver version as vulkaninfo decodes it (NVIDIA packs it differently)."""
    if vendor_id == 0x10DE:
        return f"{v >> 22 & 0x3FF}.{v >> 14 & 0xFF}.{v >> 6 & 0xFF}.{v & 0x3F}"
    return _vk_version(v)


def _size(n: int) -> str:
    for unit, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{n} B"


def _uuid(b: bytes) -> str:
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else h


def _enum_names(prefix: str) -> dict[int, str]:
    """value -> name for the ``vulkan`` package's constants with ``prefix`` (first, shortest name)."""
    from .vk.api import vk

    out: dict[int, str] = {}
    for n in sorted(dir(vk), key=len):
        if n.startswith(prefix) and "__" not in n:
            v = getattr(vk, n)
            if isinstance(v, int) and v not in out:
                out[v] = n
    return out


# ---------------------------------------------------------------------------------------
# backends


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
    from .backends import ggml_cpu

    out: dict[str, Any] = {"name": "cpu", "kind": "cpu", "available": False}
    try:
        g = ggml_cpu.load()
    except Exception as exc:  # a missing package is a reason to report
        out["detail"] = f"{exc}" + (f" ({exc.hint})" if getattr(exc, "hint", "") else "")
        return out
    cores = ggml_cpu.physical_cores()
    feats = g.features()
    out.update(available=True, ggml={"version": g.version, "commit": g.commit, "package": ggml_cpu.PACKAGE,
                                     "package_version": g.package_version, "features": feats,
                                     "physical_cores": cores},
               detail=f"ggml {g.version} ({ggml_cpu.PACKAGE} {g.package_version}), {cores} physical cores "
                      f"({os.cpu_count() or 1} logical); ggml CPU features: "
                      + (" ".join(f for f, on in feats.items() if on) or "none"))
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


# ---------------------------------------------------------------------------------------
# attach matrix

_MEM_EXT = {"dma_buf": "VK_EXT_external_memory_dma_buf", "opaque_fd": "VK_KHR_external_memory_fd",
            "host_allocation": "VK_EXT_external_memory_host"}


def _mem_can(interop: dict[str, Any], path: str, export: bool = False, import_: bool = False,
             either: bool = False) -> tuple[bool, str]:
    """Whether the hub's storage buffers support ``path`` that way; else why not."""
    e = interop["memory"][path]
    label = PATH_LABELS[path]
    if not e.get("extension_present"):
        return False, f"{label}: {e.get('extension', _MEM_EXT[path])} missing"
    if either:
        if e.get("exportable") or e.get("importable"):
            return True, ""
        return False, f"{label}: storage buffers neither exportable nor importable"
    if export and not e.get("exportable"):
        return False, f"{label}: storage buffers not exportable"
    if import_ and not e.get("importable"):
        return False, f"{label}: storage buffers not importable"
    return True, ""


def _sem_can(interop: dict[str, Any], handle: str, kind: str, export: bool, import_: bool) -> tuple[bool, str]:
    s = interop["semaphores"][handle][kind]
    label = {"opaque_fd": "opaque fd", "sync_fd": "sync fd"}[handle]
    missing = [w for w, need, have in (("export", export, s.get("exportable")),
                                       ("import", import_, s.get("importable"))) if need and not have]
    if missing:
        return False, f"hub cannot {'/'.join(missing)} {kind} semaphores as {label}"
    return True, ""


def _same_device(physical: Any, backend: dict[str, Any]) -> tuple[bool, str]:
    """Opaque handles only work within one physical device (matching device UUIDs). Backends
    that report no UUIDs are assumed to match."""
    uuids = [d.get("uuid") for d in backend.get("devices", ()) if d.get("uuid")]
    if not uuids:
        return True, ""
    mine = _uuid(getattr(physical, "device_uuid", b"") or b"")
    if not mine or mine in uuids:
        return True, ""
    return False, (f"hub '{physical.name}' is not one of the {backend.get('kind', backend['name'])} "
                   "devices (device UUIDs differ)")


def attach_matrix(physical: Any, backends: list[dict[str, Any]], interop: dict[str, Any] | None = None,
                  opaque_fd_mappable: bool | None = None, opaque_fd_reason: str = "") -> list[dict[str, Any]]:
    """The memory and event path each available backend gets with ``physical`` as the hub.

    ``backends``: dicts as :func:`probe_backends` returns (``name``, ``kind``, ``available``,
    optional ``devices`` with ``uuid``). ``interop``: :func:`vkxsplit.vk.interop.interop_report`
    of ``physical`` (queried when omitted). ``opaque_fd_mappable``: whether an exported opaque
    fd of the hub can be mmapped by the CPU (None = not checked: the path is not used).
    Each row: backend, kind, memory, memory_why_not (reasons the better memory paths are out),
    event, event_why_not, zero_copy. Rules are in docs/INFO.md.
    """
    if interop is None:
        from .vk.interop import interop_report

        interop = interop_report(physical)
    rows = []
    for b in backends:
        if not b.get("available"):
            continue
        kind = b.get("kind", b["name"])
        ev_why: list[str] = []
        event = None
        cands: list[tuple[str, bool, str]] = []  # memory paths, best first: (path, ok, why not)
        if kind in ("cpu", "npu-emu"):
            cands.append(("host_allocation", *_mem_can(interop, "host_allocation", import_=True)))
            ok, why = _mem_can(interop, "opaque_fd", export=True)
            if ok and opaque_fd_mappable is not True:
                ok = False
                why = ("opaque fd: mmap of exported fds not checked" if opaque_fd_mappable is None else
                       f"opaque fd: exported fds are not mmappable ({opaque_fd_reason or 'mmap failed'})")
            cands.append(("opaque_fd", ok, why))
        elif kind in ("cuda", "hip"):
            cands.append(("dma_buf", *_mem_can(interop, "dma_buf", export=True)))
            ok, why = _mem_can(interop, "opaque_fd", export=True)
            if ok:
                ok, why = _same_device(physical, b)
                why = f"opaque fd: {why}" if why else why
            cands.append(("opaque_fd", ok, why))
        elif kind == "npu":
            cands.append(("dma_buf", *_mem_can(interop, "dma_buf", either=True)))
        else:
            cands.append(("dma_buf", False, f"unknown backend kind {kind!r}"))
        memory, mem_why = "staged_copy", []
        for path, ok, why in cands:
            if ok:
                memory = path
                break
            mem_why.append(why)

        if kind == "npu-emu":
            # The emulator reports completion over its socket (event_handles=("host",)); a real
            # NPU with its own Vulkan device would import the opaque-fd timeline instead.
            ev_why.append("imported timeline: the npu-emu process reports completion over its socket")
        elif kind in ("cuda", "hip"):
            ok, why = _sem_can(interop, "opaque_fd", "timeline", export=True, import_=False)
            if ok:
                ok, why = _same_device(physical, b)
            event = "imported_timeline" if ok else None
            if not ok:
                ev_why.append(f"imported timeline: {why}")
        elif kind == "npu":
            ok, why = _sem_can(interop, "sync_fd", "binary", export=True, import_=True)
            event = "sync_file" if ok else None
            if not ok:
                ev_why.append(f"sync_file: {why}")
        elif kind == "cpu":
            ev_why.append("imported timeline: the cpu backend cannot import Vulkan semaphores")
        if event is None:
            event = "host_bridge"
        rows.append({"backend": b["name"], "kind": kind, "memory": memory, "memory_why_not": mem_why,
                     "event": event, "event_why_not": ev_why, "zero_copy": memory != "staged_copy"})
    return rows


def probe_opaque_fd_mappable(device: Any) -> tuple[bool, str]:
    """Whether the CPU can use an exported opaque fd of ``device`` (a vkxsplit Device) as the
    memory itself: export a small host-visible block, fill it through the Vulkan mapping, and
    check that a read-only mmap of the fd at offset 0 shows the same bytes. Nothing is written
    through the fd (a driver may keep private data in the file: lavapipe does)."""
    import mmap

    from .vk.api import ffi
    from .vk.memory import HANDLE_OPAQUE_FD, Block

    size = 1 << 16
    block = None
    fd = -1
    try:
        block = Block(device.memory, "export", size, device.memory.type_for_pool["export"],
                      export_types=HANDLE_OPAQUE_FD, dedicated=True)
        if block.ptr is None:
            return False, "exportable memory is not host-visible: cannot check what an mmap shows"
        pattern = bytes((i * 7 + 3) & 0xFF for i in range(size))
        ffi.memmove(block.ptr, pattern, size)
        fd = block.export_fd(HANDLE_OPAQUE_FD)
        length = os.fstat(fd).st_size
        if length < size:
            return False, f"the fd's file is {length} bytes, smaller than the {size}-byte allocation"
        try:
            m = mmap.mmap(fd, length, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            return False, f"mmap failed: {exc}"
        with m:
            if m[:size] == pattern:
                return True, "an mmap of the fd at offset 0 aliases the Vulkan memory"
            at = m.find(pattern[:256])
        if at > 0:
            return False, f"the memory sits at file offset {at} after driver data, not at 0"
        return False, "an mmap of the fd does not show the Vulkan memory"
    except VkxError as exc:
        return False, str(exc).splitlines()[0]
    finally:
        if fd >= 0:
            os.close(fd)
        if block is not None:
            block.close()


# ---------------------------------------------------------------------------------------
# report collection


def multi_gpu_report(devices: list[dict[str, Any]]) -> dict[str, Any]:
    """Which devices can host a pipeline stage (``--devices``, :mod:`vkxsplit.hubs`) and how
    each pair would be linked: the hidden state through host pages both import by pointer
    (VK_EXT_external_memory_host; opaque-fd memory crosses only between equal deviceUUIDs and
    driverUUIDs), events through a host relay thread."""

    def host_ok(d: dict[str, Any]) -> tuple[bool, str]:
        h = d["interop"]["memory"]["host_allocation"]
        if not h.get("extension_present"):
            return False, "no VK_EXT_external_memory_host"
        if not h.get("importable"):
            return False, "host allocations not importable"
        return True, ""

    stages = [{"index": d["index"], "name": d["name"], "can_host_stage": host_ok(d)[0],
               "reason": host_ok(d)[1]} for d in devices]
    links = []
    for a in devices:
        for b in devices:
            if a["index"] >= b["index"]:
                continue
            ok_a, why_a = host_ok(a)
            ok_b, why_b = host_ok(b)
            same = a["device_uuid"] == b["device_uuid"] and a["driver_uuid"] == b["driver_uuid"]
            links.append({"from": a["index"], "to": b["index"], "same_gpu": same,
                          "memory": "host_allocation" if ok_a and ok_b else None,
                          "events": "host relay" if ok_a and ok_b else None,
                          "reason": "" if ok_a and ok_b else f"GPU{a['index'] if not ok_a else b['index']}: "
                                                               f"{why_a or why_b}"})
    return {"stages": stages, "links": links}


def _instance_report(inst: Any) -> dict[str, Any]:
    from .vk.api import NULL, enumerate_, lib, string

    layers = [{"name": string(p.layerName), "spec_version": _vk_version(p.specVersion),
               "implementation_version": p.implementationVersion, "description": string(p.description)}
              for p in enumerate_(lib.vkEnumerateInstanceLayerProperties, "VkLayerProperties")]
    exts = [{"name": string(e.extensionName), "spec_version": e.specVersion}
            for e in enumerate_(lib.vkEnumerateInstanceExtensionProperties, "VkExtensionProperties", NULL)]
    names = {e["name"] for e in exts}
    return {
        "api_version": inst.api_version, "api_version_str": _vk_version(inst.api_version),
        "validation": bool(inst.validation),
        "layers": sorted(layers, key=lambda x: x["name"]),
        "extensions": sorted(exts, key=lambda x: x["name"]),
        "extensions_of_interest": {e: e in names for e in INSTANCE_EXTENSIONS_OF_INTEREST},
        "enabled_extensions": list(inst.enabled_extensions), "enabled_layers": list(inst.enabled_layers),
        "icd_manifests": icd_manifests(),
        "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def icd_manifests() -> list[dict[str, Any]]:
    """The driver manifests the loader will read (VK_DRIVER_FILES/VK_ICD_FILENAMES, else the
    standard directories), with the library each names."""
    env = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    files: list[Path] = []
    if env:
        for part in env.split(os.pathsep):
            p = Path(part)
            files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    else:
        for d in ICD_DIRS:
            if Path(d).is_dir():
                files += sorted(Path(d).glob("*.json"))
        for p in filter(None, os.environ.get("VK_ADD_DRIVER_FILES", "").split(os.pathsep)):
            files.append(Path(p))
    out = []
    for f in files:
        e: dict[str, Any] = {"file": str(f), "exists": f.is_file(), "library_path": None, "library_found": None}
        if f.is_file():
            try:
                lp = json.loads(f.read_text()).get("ICD", {}).get("library_path")
            except (OSError, ValueError):
                lp = None
            e["library_path"] = lp
            if lp and "/" in lp:
                e["library_found"] = (f.parent / lp).exists() if not os.path.isabs(lp) else os.path.exists(lp)
        out.append(e)
    return out


_FEATURE_ROWS = (
    # (label, feature keys, extension that provides it when not core)
    ("8-bit storage", ("storageBuffer8BitAccess",), "VK_KHR_8bit_storage"),
    ("16-bit storage", ("storageBuffer16BitAccess",), "VK_KHR_16bit_storage"),
    ("float16 arithmetic", ("shaderFloat16",), "VK_KHR_shader_float16_int8"),
    ("int8 arithmetic", ("shaderInt8",), "VK_KHR_shader_float16_int8"),
    ("int16 / int64", ("shaderInt16", "shaderInt64"), ""),
    ("bfloat16", ("shaderBFloat16Type",), "VK_KHR_shader_bfloat16"),
    ("integer dot product", ("shaderIntegerDotProduct",), "VK_KHR_shader_integer_dot_product"),
    ("subgroup size control", ("subgroupSizeControl", "computeFullSubgroups"), "VK_EXT_subgroup_size_control"),
    ("timeline semaphores", ("timelineSemaphore",), "VK_KHR_timeline_semaphore"),
    ("cooperative matrix", ("cooperativeMatrix",), "VK_KHR_cooperative_matrix"),
    ("bf16 cooperative matrix", ("shaderBFloat16CooperativeMatrix",), "VK_KHR_shader_bfloat16"),
    ("coopmat2 (workgroup scope)", ("cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                                    "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads"),
     "VK_NV_cooperative_matrix2"),
)


def _feature_rows(p: Any) -> list[dict[str, Any]]:
    rows = []
    for label, keys, ext in _FEATURE_ROWS:
        vals = [bool(p.features.get(k)) for k in keys]
        why = ""
        if not all(vals):
            if ext and ext in ("VK_KHR_cooperative_matrix", "VK_KHR_shader_bfloat16",
                               "VK_NV_cooperative_matrix2") and not p.has(ext):
                why = f"{ext} missing"
            elif keys[0] in ("subgroupSizeControl", "shaderIntegerDotProduct") and p.api_version < (1 << 22 | 3 << 12):
                why = "queried from Vulkan 1.3 features only"
            else:
                why = "not supported: " + ", ".join(k for k, v in zip(keys, vals) if not v)
        rows.append({"label": label, "features": list(keys), "values": vals, "why_not": why})
    return rows


def kernel_report(p: Any, variants: dict[str, Any]) -> dict[str, Any]:
    """Which manifest variants ``p`` can run: all ``requires`` features present and the
    required subgroup size (if any) within [min, max] with subgroup size control."""
    groups: dict[str, dict[str, int]] = {"plain": {"total": 0, "usable": 0}, "coopmat": {"total": 0, "usable": 0}}
    usable, unusable = [], []
    sizes: dict[int, dict[str, Any]] = {}
    for name, meta in sorted(variants.items()):
        req = list(meta.get("requires") or ())
        kind = "coopmat" if any("cooperativematrix" in f.lower() for f in req) else "plain"
        missing = [f for f in req if not p.features.get(f)]
        sg = int(meta.get("subgroup_size") or 0)
        if sg:
            ok = (p.min_subgroup_size <= sg <= p.max_subgroup_size
                  and (sg == p.subgroup_size or bool(p.features.get("subgroupSizeControl"))))
            s = sizes.setdefault(sg, {"size": sg, "variants": 0, "supported": ok})
            s["variants"] += 1
            if not ok:
                missing.append(f"subgroup size {sg} (device: {p.min_subgroup_size}..{p.max_subgroup_size})")
        groups[kind]["total"] += 1
        if missing:
            unusable.append({"name": name, "kind": kind, "missing": missing})
        else:
            groups[kind]["usable"] += 1
            usable.append(name)
    return {"plain": groups["plain"], "coopmat": groups["coopmat"], "usable": usable, "unusable": unusable,
            "subgroup_sizes": [sizes[k] for k in sorted(sizes)]}


def prefill_report(p: Any) -> dict[str, Any]:
    """The mat-mat path (M > 8) a hub on ``p`` takes, as record_mul_mat decides it on the
    device vkxsplit would open: mul_mat_cm2 (VK_NV_cooperative_matrix2, every type; quantized
    weights dequantized to f16 rows first where the device's dq16 model says so), mul_mat_coopmat
    (VK_KHR_cooperative_matrix) or the f32 tiled kernel; the kill switches are honoured."""
    from types import SimpleNamespace

    from .features import disabled_from_env
    from .ops.choose import DQ16_MIN_M, kernels_for
    from .vk.device import coopmat2_enablable

    kc = kernels_for(SimpleNamespace(features=p.features, physical=p, coopmat2=coopmat2_enablable(p), name=p.name,
                                     disabled=disabled_from_env()))
    if kc.coopmat2_available:
        path = "mul_mat_cm2"
    elif kc.coopmat_available:
        path = "mul_mat_coopmat"
    else:
        path = "tiled"
    dq16 = path == "mul_mat_cm2" and "dq16" not in kc.disabled
    return {"path": path, "dq16": dq16, "dq16_min_m": DQ16_MIN_M if dq16 else None}


def shader_report() -> dict[str, Any]:
    from . import shaders

    out: dict[str, Any] = {"manifest": str(shaders.MANIFEST), "manifest_variants": 0,
                           "sources_present": False, "source_dir": str(shaders.source_dir()),
                           "in_sync": None, "problems": [], "error": None, "compilers": {}}
    try:
        man = shaders.load_manifest()
    except VkxError as exc:
        out["error"] = str(exc).splitlines()[0]
        return out
    out["manifest_variants"] = len(man.get("variants", {}))
    out["compilers"] = man.get("compilers", {})
    if shaders.source_dir().is_dir():
        out["sources_present"] = True
        try:
            problems = shaders.check_manifest()
        except Exception as exc:  # a broken op module must not hide the rest of the report
            out["error"] = f"check_manifest failed: {type(exc).__name__}: {exc}"
        else:
            out["problems"] = problems
            out["in_sync"] = not problems
    return out


def _coop_types(c: Any) -> dict[str, Any]:
    """Component types, saturation and scope of a cooperative-matrix shape (KHR or NV flexible)."""
    def name(v: int) -> str:
        return COMPONENT_TYPES.get(v, str(v))

    return {"a_type": name(c.a_type), "b_type": name(c.b_type), "c_type": name(c.c_type),
            "result_type": name(c.result_type), "saturating": c.saturating,
            "scope": SCOPES.get(c.scope, str(c.scope))}


def _device_report(p: Any) -> dict[str, Any]:
    from .vk.interop import interop_report

    driver_ids = _enum_names("VK_DRIVER_ID_")
    lim = {k: (list(v) if isinstance(v, tuple) else v) for k, v in p.limits.items()}
    coop_ext = p.has("VK_KHR_cooperative_matrix")
    return {
        "index": p.index, "name": p.name, "type": DEVICE_TYPES.get(p.device_type, "unknown"),
        "type_id": p.device_type, "vendor_id": p.vendor_id, "vendor": VENDORS.get(p.vendor_id, "unknown"),
        "device_id": p.device_id, "api_version": p.api_version, "api_version_str": _vk_version(p.api_version),
        "driver_version": p.driver_version,
        "driver_version_str": driver_version_str(p.vendor_id, p.driver_version),
        "driver_id": p.driver_id, "driver_id_name": driver_ids.get(p.driver_id, ""),
        "driver_name": p.driver_name, "driver_info": p.driver_info,
        "device_uuid": _uuid(p.device_uuid), "driver_uuid": _uuid(p.driver_uuid),
        "memory_heaps": [{"index": h.index, "size": h.size, "flags": flag_names(h.flags, MEMORY_HEAP_FLAGS),
                          "flags_mask": h.flags} for h in p.memory_heaps],
        "memory_types": [{"index": t.index, "heap": t.heap, "flags": flag_names(t.flags, MEMORY_PROPERTY_FLAGS),
                          "flags_mask": t.flags} for t in p.memory_types],
        "queue_families": [{"index": q.index, "flags": flag_names(q.flags, QUEUE_FLAGS), "flags_mask": q.flags,
                            "count": q.count, "timestamp_valid_bits": q.timestamp_bits}
                           for q in p.queue_families],
        "compute_units": p.compute_units,
        "subgroup": {"size": p.subgroup_size, "min_size": p.min_subgroup_size, "max_size": p.max_subgroup_size,
                     "compute_stage": bool(p.subgroup_stages & SHADER_STAGE_COMPUTE),
                     "operations": flag_names(p.subgroup_ops, SUBGROUP_OPS)},
        "features": dict(p.features),
        "feature_summary": _feature_rows(p),
        "limits": lim,
        "cooperative_matrix": {
            "extension_present": coop_ext, "supported": bool(p.features.get("cooperativeMatrix")),
            "shapes": [{"m": c.m, "n": c.n, "k": c.k, **_coop_types(c)} for c in p.coopmat_shapes],
            "coopmat2": {"extension_present": p.has("VK_NV_cooperative_matrix2"),
                         "properties": dict(getattr(p, "coopmat2", {}) or {}),
                         "flexible": [{"granularity": [f.m_granularity, f.n_granularity, f.k_granularity],
                                       **_coop_types(f), "workgroup_invocations": f.workgroup_invocations}
                                      for f in getattr(p, "coopmat2_flex", [])]}},
        "extensions": [{"name": n, "spec_version": v} for n, v in sorted(p.extensions.items())],
        "interop": interop_report(p),
    }


class _Glfw:
    """A GLFW session with one hidden NO_API window (for ``--surface``)."""

    def __init__(self) -> None:
        self.glfw: Any = None
        self.window: Any = None
        self.errors: list[str] = []
        self.extensions: list[str] = []
        self.version = ""

    def open(self) -> str:
        """Returns "" when ready, else why not."""
        try:
            import glfw
        except Exception as exc:
            return f"the Python package glfw is not usable ({exc}); pip install glfw"
        self.glfw = glfw
        glfw.set_error_callback(lambda code, desc: self.errors.append(
            desc.decode(errors="replace") if isinstance(desc, bytes) else str(desc)))
        try:
            self.version = glfw.get_version_string().decode(errors="replace")
        except Exception:
            self.version = ""
        if not glfw.init():
            self.glfw = None
            why = "; ".join(self.errors) or "glfwInit failed"
            return f"no display: {why}"
        if not glfw.vulkan_supported():
            return "GLFW found no Vulkan loader (glfwVulkanSupported is false)"
        self.extensions = list(glfw.get_required_instance_extensions() or [])
        if not self.extensions:
            return "GLFW reports no Vulkan surface extensions for this platform"
        glfw.window_hint(glfw.CLIENT_API, glfw.NO_API)
        glfw.window_hint(glfw.VISIBLE, glfw.FALSE)
        self.window = glfw.create_window(64, 64, "vkxsplit info", None, None)
        if not self.window:
            return "could not create a window: " + ("; ".join(self.errors) or "unknown error")
        return ""

    def platform(self) -> str:
        g = self.glfw
        if g is None or not hasattr(g, "get_platform"):
            return ""
        names = {getattr(g, n, None): n[len("PLATFORM_"):].lower()
                 for n in ("PLATFORM_WIN32", "PLATFORM_COCOA", "PLATFORM_WAYLAND", "PLATFORM_X11",
                           "PLATFORM_NULL")}
        try:
            return names.get(g.get_platform(), "")
        except Exception:
            return ""

    def close(self) -> None:
        if self.glfw is None:
            return
        if self.window:
            self.glfw.destroy_window(self.window)
            self.window = None
        self.glfw.terminate()
        self.glfw.set_error_callback(None)
        self.glfw = None


def _surface_per_device(inst: Any, gl: _Glfw, devices: list[Any]) -> tuple[str, dict[int, Any]]:
    from .vk.api import NULL, check, enumerate_, ffi, string  # noqa: F401

    surf = ffi.new("VkSurfaceKHR*")
    res = gl.glfw.create_window_surface(inst.handle, gl.window, None, surf)
    if res != 0:
        from .vk.result import result_name

        return f"glfwCreateWindowSurface failed with {result_name(res)}", {}
    surface = surf[0]
    formats = _enum_names("VK_FORMAT_")
    spaces = _enum_names("VK_COLOR_SPACE_")
    modes = _enum_names("VK_PRESENT_MODE_")
    out: dict[int, Any] = {}
    try:
        support_fn = inst.proc("vkGetPhysicalDeviceSurfaceSupportKHR")
        formats_fn = inst.proc("vkGetPhysicalDeviceSurfaceFormatsKHR")
        modes_fn = inst.proc("vkGetPhysicalDeviceSurfacePresentModesKHR")
        caps_fn = inst.proc("vkGetPhysicalDeviceSurfaceCapabilitiesKHR")
        for p in devices:
            d: dict[str, Any] = {}
            sup = ffi.new("VkBool32*")
            d["presentation_support"] = []
            for q in p.queue_families:
                check(support_fn(p.handle, q.index, surface, sup), "vkGetPhysicalDeviceSurfaceSupportKHR")
                d["presentation_support"].append(bool(sup[0]))
            fmts = enumerate_(formats_fn, "VkSurfaceFormatKHR", p.handle, surface)
            d["formats"] = [{"format": formats.get(f.format, str(f.format)),
                             "color_space": spaces.get(f.colorSpace, str(f.colorSpace))} for f in fmts]
            pms = enumerate_(modes_fn, "VkPresentModeKHR", p.handle, surface)
            d["present_modes"] = [modes.get(int(m), str(int(m))) for m in pms]
            caps = ffi.new("VkSurfaceCapabilitiesKHR*")
            check(caps_fn(p.handle, surface, caps), "vkGetPhysicalDeviceSurfaceCapabilitiesKHR")
            d["capabilities"] = {"min_image_count": caps.minImageCount, "max_image_count": caps.maxImageCount,
                                 "current_extent": [caps.currentExtent.width, caps.currentExtent.height]}
            out[p.index] = d
    finally:
        inst.proc("vkDestroySurfaceKHR")(inst.handle, surface, NULL)
    return "", out


def collect(device: int | None = None, surface: bool = False, dev_root: str = "/dev",
            sys_root: str = "/sys") -> dict[str, Any]:
    """The whole report as plain data (the ``--json`` document)."""
    from .vk.api import vk  # noqa: F401  (raises EnvironmentProblem without a Vulkan loader)
    from .vk.instance import Instance

    gl: _Glfw | None = None
    surface_info: dict[str, Any] | None = None
    extra: list[str] = []
    if surface:
        gl = _Glfw()
        why = gl.open()
        surface_info = {"requested": True, "available": not why, "reason": why, "glfw_version": gl.version,
                        "platform": gl.platform(), "instance_extensions": list(gl.extensions)}
        if why:
            gl.close()
            gl = None
        else:
            extra = list(gl.extensions)
    try:
        try:
            inst = Instance(extra_extensions=extra)
        except EnvironmentProblem as exc:
            if not extra or "lacks instance extension" not in str(exc):
                _explain_driver_problem(exc)
                raise
            assert surface_info is not None and gl is not None
            surface_info.update(available=False, reason=str(exc).splitlines()[0])
            gl.close()
            gl = None
            inst = Instance()
        try:
            return _collect_with(inst, device, gl, surface_info, dev_root, sys_root)
        finally:
            inst.close()
    finally:
        if gl is not None:
            gl.close()


def _explain_driver_problem(exc: EnvironmentProblem) -> None:
    """Raise a copy of ``exc`` whose hint also lists what the loader read, for ICD failures."""
    if "(ICD)" not in str(exc):
        return
    parts = []
    for e in icd_manifests():
        what = e["file"]
        if not e["exists"]:
            what += " (file missing)"
        elif e["library_found"] is False:
            what += f" (library {e['library_path']} missing)"
        parts.append(what)
    msg = str(exc).split("\n", 1)[0]
    raise EnvironmentProblem(msg, f"{exc.hint}. Driver manifests the loader read: "
                             + (", ".join(parts) or "none")) from exc


def _no_device_hint() -> str:
    icds = icd_manifests()
    seen = ", ".join(Path(e["file"]).name + ("" if e["exists"] else " (missing)") for e in icds) or "none"
    return (f"the loader read these driver manifests: {seen}; none found a device. Install the "
            "driver for your GPU, or mesa-vulkan-drivers for lavapipe (CPU); check VK_DRIVER_FILES; "
            "`vulkaninfo --summary` shows what the loader sees")


def _collect_with(inst: Any, device: int | None, gl: _Glfw | None, surface_info: dict[str, Any] | None,
                  dev_root: str, sys_root: str) -> dict[str, Any]:
    from . import __version__
    from .errors import VulkanError
    from .vk.result import result_name

    try:
        physicals = inst.physical_devices()
    except VulkanError as exc:
        raise EnvironmentProblem(
            f"Vulkan found no usable physical device (vkEnumeratePhysicalDevices returned "
            f"{result_name(exc.result)})", _no_device_hint()) from exc
    if not physicals:
        raise EnvironmentProblem("Vulkan found no physical device", _no_device_hint())
    hub: int | None = None
    hub_error = ""
    if device is not None:
        if not 0 <= device < len(physicals):
            raise EnvironmentProblem(
                f"device index {device} does not exist (found {len(physicals)}: "
                + ", ".join(f"{p.index}={p.name}" for p in physicals) + ")",
                "pass --device with one of those indices, or leave it out to see all devices")
        hub = device
        shown = [physicals[hub]]
    else:
        try:
            hub = inst.select().index
        except EnvironmentProblem as exc:
            hub_error = str(exc).splitlines()[0]
        shown = list(physicals)

    backends = probe_backends(dev_root, sys_root)
    shaders = shader_report()
    variants: dict[str, Any] = {}
    try:
        from .shaders import load_manifest

        variants = load_manifest().get("variants", {})
    except VkxError:
        pass

    devices = []
    for p in shown:
        d = _device_report(p)
        d["default_hub"] = p.index == hub
        mem = d["interop"]["memory"]
        mappable: bool | None = None
        mappable_why = ""
        host_ok = mem["host_allocation"]["extension_present"] and mem["host_allocation"]["importable"]
        if not host_ok and mem["opaque_fd"]["extension_present"] and mem["opaque_fd"]["exportable"]:
            from .vk.device import Device

            try:
                dev = Device(inst, p)
            except VkxError as exc:
                mappable, mappable_why = False, "no logical device: " + str(exc).splitlines()[0]
            else:
                try:
                    mappable, mappable_why = probe_opaque_fd_mappable(dev)
                finally:
                    dev.close()
        d["interop"]["opaque_fd_mappable"] = mappable
        d["interop"]["opaque_fd_mappable_detail"] = mappable_why
        d["kernels"] = kernel_report(p, variants)
        from .ops.choose import kernels_for

        # decode mat-vecs that read x as q8_1 (integer dot products), by weight type
        d["kernels"]["decode_q8_1"] = kernels_for(p).vecq_decode()
        d["kernels"]["prefill"] = prefill_report(p)
        d["attach_matrix"] = attach_matrix(p, backends, d["interop"], mappable, mappable_why)
        devices.append(d)

    if gl is not None and surface_info is not None:
        why, per_dev = _surface_per_device(inst, gl, shown)
        if why:
            surface_info.update(available=False, reason=why)
        for d in devices:
            d["surface"] = per_dev.get(d["index"])
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "vkxsplit", "version": __version__, "python": platform.python_version(),
                 "platform": platform.platform()},
        "instance": _instance_report(inst),
        "device_count": len(physicals),
        "hub_device": hub,
        "hub_error": hub_error,
        "devices": devices,
        "multi_gpu": multi_gpu_report(devices),
        "shaders": shaders,
        "backends": backends,
        "device_nodes": device_nodes(dev_root),
        "surface": surface_info,
        "validation_messages": list(inst.messages),
    }


# ---------------------------------------------------------------------------------------
# text rendering

_LABEL = 22


def _wrap(text: str, indent: str, first: str = "") -> list[str]:
    first = first or indent
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=indent,
                         break_on_hyphens=False) or [first.rstrip()]


def _kv(label: str, value: Any, indent: str = "  ") -> list[str]:
    head = f"{indent}{label:<{_LABEL}} = "
    return _wrap(str(value), " " * len(head), head)


def _table_rows(header: list[str], rows: list[list[str]], indent: str = "    ") -> list[list[str]]:
    """Aligned columns, the last one wrapped to the width: the lines of each row (header first)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    out = []
    for r in [header, *rows]:
        lead = indent + "".join(f"{str(c):<{w}}  " for c, w in zip(r[:-1], widths))
        last = str(r[-1])
        if last and max(len(w) for w in last.split()) > WIDTH - len(lead):
            # a word too long for the column: the cell goes below the row, indented
            out.append([lead.rstrip(), *_wrap(last, indent + "    ")])
        else:
            out.append(_wrap(last, " " * len(lead), lead))
    return out


def _table(header: list[str], rows: list[list[str]], indent: str = "    ") -> list[str]:
    return [line for row in _table_rows(header, rows, indent) for line in row]


def _yn(b: Any) -> str:
    return "yes" if b else "no"


def _heading(title: str, char: str = "=") -> list[str]:
    title = title if len(title) <= WIDTH else title[:WIDTH - 3] + "..."
    return ["", title, char * len(title)]


def render_text(r: dict[str, Any]) -> str:
    L: list[str] = []
    t = r["tool"]
    L.append(f"vkxsplit {t['version']} info (schema {r['schema_version']})")
    L += _wrap(f"Python {t['python']}, {t['platform']}", "  ", "")

    inst = r["instance"]
    L += _heading("Instance")
    L += _kv("loader version", inst["api_version_str"], "")
    L += _kv("validation", "on" if inst["validation"] else "off", "")
    L += _kv("layers", ", ".join(f"{x['name']} {x['spec_version']}" for x in inst["layers"]) or "none", "")
    icds = [Path(e["file"]).name + ("" if e["exists"] else " (missing)")
            + (" (library missing)" if e["library_found"] is False else "") for e in inst["icd_manifests"]]
    L += _kv("driver manifests", ", ".join(icds) or "none found", "")
    for k, v in inst["environment"].items():
        L += _kv(k, v, "")
    L += _kv("extensions", f"{len(inst['extensions'])} available (full list: --json)", "")
    L += _table(["of interest", "present"],
                [[n, _yn(v)] for n, v in inst["extensions_of_interest"].items()], "  ")

    L += _heading(f"Devices: {r['device_count']}"
                  + (f", default hub GPU{r['hub_device']}" if r["hub_device"] is not None else ""))
    if r.get("hub_error"):
        L += _wrap(f"default hub: {r['hub_error']}", "  ", "")
    for d in r["devices"]:
        L += _render_device(d)

    mg = r.get("multi_gpu")
    if mg is not None:
        L += _heading("Multi-GPU (--devices, --split-mode layer or row: one hub per device)")
        ok = [f"GPU{x['index']}" for x in mg["stages"] if x["can_host_stage"]]
        L += _kv("can host a stage", ", ".join(ok) or "none", "")
        for x in mg["stages"]:
            if not x["can_host_stage"]:
                L += _kv(f"GPU{x['index']}", f"cannot: {x['reason']}", "  ")
        for ln in mg["links"]:
            what = ("hidden state / partial sums through host pages, events by a host relay"
                    + (" (one GPU: two hubs on it)" if ln["same_gpu"] else "")) if ln["memory"] else \
                f"no link: {ln['reason']}"
            L += _kv(f"GPU{ln['from']} -> GPU{ln['to']}", what, "  ")
        if len(mg["stages"]) == 1 and ok:
            L += _wrap(f"one device: --devices {mg['stages'][0]['index']},{mg['stages'][0]['index']} runs two hubs "
                       "on it (how the pipeline is tested without a second GPU)", "  ", "")

    s = r["shaders"]
    L += _heading("Shaders")
    L += _kv("shipped manifest", f"{s['manifest_variants']} variants", "")
    if s.get("error"):
        L += _kv("problem", s["error"], "")
    if not s["sources_present"]:
        L += _kv("sources", f"sources not present, shipped manifest has {s['manifest_variants']} variants", "")
    elif s["in_sync"] is not None:
        L += _kv("sources", f"{s['source_dir']}: " + ("SPIR-V in sync with sources" if s["in_sync"] else
                 f"{len(s['problems'])} problem(s); run `vkxsplit build-shaders`"), "")
        for p in s["problems"][:20]:
            L += _wrap(p, "    ", "  - ")
        if len(s["problems"]) > 20:
            L.append(f"  ... {len(s['problems']) - 20} more (--json)")

    L += _heading("Backends")
    table = _table_rows(["backend", "found", "detail"],
                        [[b["name"], _yn(b["available"]), b.get("detail", "")] for b in r["backends"]], "  ")
    L += table[0]
    for b, lines in zip(r["backends"], table[1:]):
        L += lines
        for dev in b.get("devices") or ():
            L += _wrap(f"{b['name']}{dev['index']}: {dev.get('name') or '?'}"
                       + (f", uuid {dev['uuid']}" if dev.get("uuid") else ""), "        ", "    ")
    n = r["device_nodes"]
    L += _kv("/dev/dma_heap", ", ".join(n["dma_heap"]) if n["dma_heap"] is not None else "absent", "")
    L += _kv("/dev/udmabuf", "present" if n["udmabuf"] else "absent", "")
    L += _kv("/dev/dri render nodes", ", ".join(n["dri_render"]) or "none", "")

    sf = r.get("surface")
    if sf is not None:
        L += _heading("Surface (--surface)")
        L += _kv("GLFW", f"{sf.get('glfw_version') or '?'}" + (f", platform {sf['platform']}"
                                                               if sf.get("platform") else ""), "")
        if not sf["available"]:
            L += _kv("surface", f"not available: {sf['reason']}", "")
        else:
            L += _kv("instance extensions", ", ".join(sf["instance_extensions"]), "")
            for d in r["devices"]:
                ds = d.get("surface")
                if not ds:
                    continue
                L.append(f"  GPU{d['index']}: {d['name']}")
                fams = [f"{i}:{_yn(v)}" for i, v in enumerate(ds["presentation_support"])]
                L += _kv("present (family:ok)", " ".join(fams), "    ")
                L += _kv("present modes", " ".join(m.replace("VK_PRESENT_MODE_", "") for m in ds["present_modes"]),
                         "    ")
                L += _kv("formats", ", ".join(f"{f['format'].replace('VK_FORMAT_', '')}/"
                                              f"{f['color_space'].replace('VK_COLOR_SPACE_', '')}"
                                              for f in ds["formats"]), "    ")
                c = ds["capabilities"]
                L += _kv("images", f"min {c['min_image_count']}, max {c['max_image_count'] or 'unbounded'}, "
                         f"extent {c['current_extent'][0]}x{c['current_extent'][1]}", "    ")
    if r.get("validation_messages"):
        L += _heading("Validation messages")
        for m in r["validation_messages"]:
            L += _wrap(m, "    ", "  - ")
    # Safety net: nothing over the width (a long unbreakable token is split).
    out = []
    for line in L:
        if len(line) <= WIDTH:
            out.append(line)
        else:
            ind = " " * (len(line) - len(line.lstrip()) + 4)
            out += textwrap.wrap(line.strip(), WIDTH, initial_indent=ind[:-4], subsequent_indent=ind)
    return "\n".join(out) + "\n"


def _render_device(d: dict[str, Any]) -> list[str]:
    L = _heading(f"GPU{d['index']}: {d['name']}" + ("  [default hub]" if d.get("default_hub") else ""), "-")
    L += _kv("type", d["type"])
    L += _kv("vendorID / deviceID", f"{d['vendor_id']:#06x} ({d['vendor']}) / {d['device_id']:#06x}")
    L += _kv("driver", f"{d['driver_name']}: {d['driver_info']}" if d["driver_info"] else d["driver_name"])
    L += _kv("driverID", f"{d['driver_id_name'].replace('VK_DRIVER_ID_', '') or '?'} ({d['driver_id']})")
    L += _kv("apiVersion", f"{d['api_version_str']} ({d['api_version']})")
    L += _kv("driverVersion", f"{d['driver_version_str']} ({d['driver_version']:#x})")
    L += _kv("deviceUUID", d["device_uuid"])

    L.append("  Memory heaps")
    L += _table(["heap", "size", "flags"],
                [[str(h["index"]), _size(h["size"]), " ".join(_short(f) for f in h["flags"]) or "-"]
                 for h in d["memory_heaps"]])
    L.append("  Memory types")
    L += _table(["type", "heap", "flags"],
                [[str(t["index"]), str(t["heap"]), " ".join(_short(f) for f in t["flags"]) or "-"]
                 for t in d["memory_types"]])
    L.append("  Queue families")
    L += _table(["family", "count", "timestamp bits", "flags"],
                [[str(q["index"]), str(q["count"]), str(q["timestamp_valid_bits"]),
                  " ".join(_short(f) for f in q["flags"]) or "-"] for q in d["queue_families"]])

    lim = d["limits"]
    sg = d["subgroup"]
    L.append("  Compute")
    L += _kv("compute units", str(d.get("compute_units") or "not reported"), "    ")
    L += _kv("subgroup size", f"{sg['size']} (min {sg['min_size']}, max {sg['max_size']})", "    ")
    L += _kv("subgroup operations", " ".join(sg["operations"]) or "none", "    ")
    L += _kv("max shared memory", f"{lim['maxComputeSharedMemorySize']} bytes", "    ")
    L += _kv("max push constants", f"{lim['maxPushConstantsSize']} bytes", "    ")
    L += _kv("maxStorageBufferRange", f"{lim['maxStorageBufferRange']} ({_size(lim['maxStorageBufferRange'])})",
             "    ")
    wg = lim.get("maxComputeWorkGroupSize", [0, 0, 0])
    L += _kv("max workgroup", f"{lim['maxComputeWorkGroupInvocations']} invocations, size "
             + "x".join(str(x) for x in wg), "    ")
    L += _kv("timestampPeriod", f"{lim['timestampPeriod']:g} ns", "    ")

    L.append("  Features that pick kernels")
    L += _table(["feature", "ok", "why not"],
                [[f["label"], "/".join(_yn(v) for v in f["values"]), f["why_not"]] for f in d["feature_summary"]])
    cm = d["cooperative_matrix"]
    if cm["shapes"]:
        L.append(f"  Cooperative matrix shapes: {len(cm['shapes'])}")
        L += _table(["MxNxK", "A", "B", "C", "result", "scope"],
                    [[f"{c['m']}x{c['n']}x{c['k']}", c["a_type"], c["b_type"], c["c_type"], c["result_type"]
                      + (" sat" if c["saturating"] else ""), c["scope"]] for c in cm["shapes"]])
    elif cm["extension_present"]:
        L.append("  Cooperative matrix shapes: none reported")
    cm2 = cm.get("coopmat2", {})
    if cm2.get("flexible"):
        props = cm2.get("properties", {})
        L.append(f"  Workgroup-scope (VK_NV_cooperative_matrix2) shapes: {len(cm2['flexible'])}; max workgroup "
                 f"{props.get('cooperativeMatrixWorkgroupScopeMaxWorkgroupSize', '?')}, max dimension "
                 f"{props.get('cooperativeMatrixFlexibleDimensionsMaxDimension', '?')}, reserved shared "
                 f"{props.get('cooperativeMatrixWorkgroupScopeReservedSharedMemory', '?')} bytes")
        L += _table(["granularity", "A", "B", "C", "result", "scope", "invocations"],
                    [["x".join(map(str, f["granularity"])), f["a_type"], f["b_type"], f["c_type"],
                      f["result_type"] + (" sat" if f["saturating"] else ""), f["scope"],
                      str(f["workgroup_invocations"])] for f in cm2["flexible"]])

    from .vk.device import OPTIONAL_EXTENSIONS

    names = {e["name"] for e in d["extensions"]}
    interest = list(dict.fromkeys((*OPTIONAL_EXTENSIONS, *_MORE_DEVICE_EXTENSIONS)))
    L.append(f"  Extensions: {len(names)} (full list: --json)")
    L += _kv("present", " ".join(e for e in interest if e in names) or "none", "    ")
    L += _kv("missing", " ".join(e for e in interest if e not in names) or "none", "    ")

    it = d["interop"]
    L.append("  Interop")
    rows = []
    for path in ("dma_buf", "opaque_fd", "host_allocation"):
        m = it["memory"][path]
        note = "" if m["extension_present"] else f"{m['extension']} missing"
        if path == "host_allocation" and m["extension_present"]:
            note = f"min pointer alignment {it['min_imported_host_pointer_alignment']}"
        if path == "opaque_fd" and it.get("opaque_fd_mappable") is not None:
            note = ("mmappable" if it["opaque_fd_mappable"] else "not mmappable") + \
                f": {it.get('opaque_fd_mappable_detail', '')}"
        if m.get("dedicated_only"):
            note = (note + "; " if note else "") + "dedicated only"
        rows.append(["buffer", PATH_LABELS[path], _yn(m["exportable"]), _yn(m["importable"]), note])
    for h in ("opaque_fd", "sync_fd"):
        for kind in ("binary", "timeline"):
            s = it["semaphores"][h][kind]
            rows.append([f"{kind} sem.", h.replace("_", " "), _yn(s["exportable"]), _yn(s["importable"]), ""])
    for h in ("opaque_fd", "sync_fd"):
        f = it["fences"][h]
        rows.append(["fence", h.replace("_", " "), _yn(f["exportable"]), _yn(f["importable"]), ""])
    L += _table(["object", "handle", "export", "import", "note"], rows)

    k = d["kernels"]
    L.append("  Kernels")
    for kind in ("plain", "coopmat"):
        g = k[kind]
        L += _kv(kind, f"{g['usable']} of {g['total']} shipped variants usable", "    ")
    if k["subgroup_sizes"]:
        L += _kv("required subgroups", ", ".join(
            f"{s['size']} ({s['variants']} variants, {'ok' if s['supported'] else 'unsupported'})"
            for s in k["subgroup_sizes"]), "    ")
    else:
        L += _kv("required subgroups", "none (no variant requires a subgroup size)", "    ")
    by_missing: dict[str, list[str]] = {}
    for u in k["unusable"]:
        by_missing.setdefault(", ".join(u["missing"]), []).append(u["name"])
    for miss, vs in by_missing.items():
        L += _wrap(f"missing {miss}: {len(vs)} variant(s): " + " ".join(vs[:6])
                   + (" ..." if len(vs) > 6 else ""), "        ", "    - ")
    dq = k.get("decode_q8_1") or {}
    shapes: dict[str, list[str]] = {}
    for t, v in sorted(dq.items()):
        shapes.setdefault(v.rsplit("_m1_", 1)[1], []).append(t)
    L += _kv("decode x as q8_1", "; ".join(f"{', '.join(ts)} ({sh})" for sh, ts in shapes.items())
             if dq else "no (f32 x: no integer dot products here, or VKXSPLIT_DISABLE=intdot)", "    ")
    pf = k.get("prefill")
    if pf:
        what = {"mul_mat_cm2": "mul_mat_cm2 (VK_NV_cooperative_matrix2), every type",
                "mul_mat_coopmat": "mul_mat_coopmat (VK_KHR_cooperative_matrix)",
                "tiled": "tiled f32 kernel (no usable cooperative matrices)"}[pf["path"]]
        if pf["dq16"]:
            what += f"; quantized weights dequantized to f16 first where modelled faster (M >= {pf['dq16_min_m']})"
        L += _kv("prefill (M > 8)", what, "    ")

    L.append(f"  Attach matrix (GPU{d['index']} as hub; under each row: why not a better path)")
    rows2 = [[row["backend"], PATH_LABELS[row["memory"]], PATH_LABELS[row["event"]]] for row in d["attach_matrix"]]
    table = _table_rows(["backend", "memory", "event"], rows2)
    L += table[0]
    for lines, row in zip(table[1:], d["attach_matrix"]):
        L += lines
        for why in row["memory_why_not"] + row["event_why_not"]:
            L += _wrap(why, "          ", "      - ")
    return L


# ---------------------------------------------------------------------------------------
# command


def _cmd_info(args: argparse.Namespace) -> int:
    report = collect(device=args.device, surface=args.surface)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report))
    sys.stdout.flush()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "info", help="what this machine can split with what (Vulkan devices, interop, backends)",
        description="A vulkaninfo-style report of the Vulkan hub devices, their interop handles, "
        "the kernels each would run, the backends found and how each would attach. "
        "Paste it into bug reports. The --json schema is in docs/INFO.md.")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema in docs/INFO.md)")
    p.add_argument("--device", type=int, metavar="N", help="show only physical device N (and use it as hub)")
    p.add_argument("--surface", action="store_true",
                   help="also create a window surface (GLFW) and report presentation support")
    p.set_defaults(func=_cmd_info)


__all__ = ["SCHEMA_VERSION", "attach_matrix", "collect", "kernel_report", "probe_backends",
           "probe_opaque_fd_mappable", "register", "render_text"]
