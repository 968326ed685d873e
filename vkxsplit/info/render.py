"""The ``info`` report as vulkaninfo-style text (:func:`render_text`): aligned tables and
key = value lines wrapped to :data:`WIDTH` columns, one section per part of the report.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .matrix import PATH_LABELS

WIDTH = 80

# Beyond vkxsplit.vk.device.OPTIONAL_EXTENSIONS (what the hub enables when offered).
_MORE_DEVICE_EXTENSIONS = ("VK_NV_cooperative_matrix2", "VK_KHR_buffer_device_address",
                           "VK_KHR_shader_subgroup_rotate", "VK_EXT_memory_budget")


def _short(vkname: str) -> str:
    for p in ("VK_QUEUE_", "VK_MEMORY_PROPERTY_", "VK_MEMORY_HEAP_"):
        if vkname.startswith(p):
            vkname = vkname[len(p):]
    return vkname.replace("_BIT", "")


def _size(n: int) -> str:
    for unit, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{n} B"


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

    from ..vk.device import OPTIONAL_EXTENSIONS

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
