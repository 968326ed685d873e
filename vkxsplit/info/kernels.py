"""The kernels part of the ``info`` report: which shipped SPIR-V variants a device can run
(:func:`kernel_report`), the mat-mat path its hub would take for prefill
(:func:`prefill_report`) and whether the shipped manifest is in sync with the shader sources
(:func:`shader_report`).
"""

from __future__ import annotations

from typing import Any

from ..errors import VkxError


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

    from ..features import disabled_from_env
    from ..ops.choose import DQ16_MIN_M, kernels_for
    from ..vk.device import coopmat2_enablable

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
    from .. import shaders

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
