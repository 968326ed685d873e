"""The ``info`` report as plain data (the ``--json`` document, schema in docs/INFO.md): the
instance (loader, layers, driver manifests, environment), each physical device (properties,
memory, queues, the features that pick kernels, cooperative-matrix shapes, extensions,
interop), the kernels each runs, the backends and the attach matrix, the multi-GPU links;
:func:`collect` gathers it all, and failures to find a driver or device are explained.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from ..errors import EnvironmentProblem, VkxError
from .backends import device_nodes, probe_backends
from .kernels import kernel_report, prefill_report, shader_report
from .matrix import attach_matrix, probe_opaque_fd_mappable
from .names import (
    COMPONENT_TYPES,
    DEVICE_TYPES,
    MEMORY_HEAP_FLAGS,
    MEMORY_PROPERTY_FLAGS,
    QUEUE_FLAGS,
    SCOPES,
    SHADER_STAGE_COMPUTE,
    SUBGROUP_OPS,
    VENDORS,
    _enum_names,
    _uuid,
    _vk_version,
    driver_version_str,
    flag_names,
)
from .surface import _Glfw, _surface_per_device

SCHEMA_VERSION = 1

INSTANCE_EXTENSIONS_OF_INTEREST = (
    "VK_KHR_get_physical_device_properties2", "VK_KHR_external_memory_capabilities",
    "VK_KHR_external_semaphore_capabilities", "VK_KHR_external_fence_capabilities",
    "VK_KHR_portability_enumeration", "VK_EXT_debug_utils", "VK_KHR_surface",
    "VK_KHR_xlib_surface", "VK_KHR_xcb_surface", "VK_KHR_wayland_surface", "VK_EXT_headless_surface",
)
ENV_VARS = ("VK_DRIVER_FILES", "VK_ICD_FILENAMES", "VK_ADD_DRIVER_FILES", "VK_LAYER_PATH",
            "VK_ADD_LAYER_PATH", "VK_INSTANCE_LAYERS", "VK_LOADER_LAYERS_ENABLE",
            "VK_LOADER_LAYERS_DISABLE", "VK_LOADER_DEBUG", "VKXSPLIT_DEVICE", "VKXSPLIT_VALIDATION")
ICD_DIRS = ("/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/usr/share/vulkan/icd.d")


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
    from ..vk.api import NULL, enumerate_, lib, string

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


def _coop_types(c: Any) -> dict[str, Any]:
    """Component types, saturation and scope of a cooperative-matrix shape (KHR or NV flexible)."""
    def name(v: int) -> str:
        return COMPONENT_TYPES.get(v, str(v))

    return {"a_type": name(c.a_type), "b_type": name(c.b_type), "c_type": name(c.c_type),
            "result_type": name(c.result_type), "saturating": c.saturating,
            "scope": SCOPES.get(c.scope, str(c.scope))}


def _device_report(p: Any) -> dict[str, Any]:
    from ..vk.interop import interop_report

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


def collect(device: int | None = None, surface: bool = False, dev_root: str = "/dev",
            sys_root: str = "/sys") -> dict[str, Any]:
    """The whole report as plain data (the ``--json`` document)."""
    from ..vk.api import vk  # noqa: F401  (raises EnvironmentProblem without a Vulkan loader)
    from ..vk.instance import Instance

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
    from .. import __version__
    from ..errors import VulkanError
    from ..vk.result import result_name

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
        from ..shaders import load_manifest

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
            from ..vk.device import Device

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
        from ..ops.choose import kernels_for

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
