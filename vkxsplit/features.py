"""Kill switches: one per kernel feature, for bisecting a suspected kernel or comparing paths.

``VKXSPLIT_DISABLE`` is a comma-separated list of feature names (case and spaces ignored):

- ``coopmat``: no cooperative-matrix kernels; products over 8 rows take the tiled f32 kernel
  (and so neither ``mul_mat_cm2`` nor dequantize-first runs)
- ``coopmat2``: the subgroup-scope ``mul_mat_coopmat`` where VK_NV_cooperative_matrix2 would
  run ``mul_mat_cm2`` (and so no dequantize-first)
- ``intdot``: decode mat-vecs read x as f32 (no q8_1 x, no integer dot products)
- ``dq16``: quantized products never dequantize the weights to f16 rows first
- ``splitk``: cooperative-matrix products never split K
- ``attn_coopmat``: prefill-sized attention runs the f32 tiled kernel, not the
  cooperative-matrix one (``coopmat`` switches it off too)
- ``fusion``: the model graph without fused kernels: every fusion pass below off
- ``bf16_reduce``: the row split's all-reduce sends its partial sums in f32 at every size (no
  bf16 compression of the large ones: :mod:`vkxsplit.hubs`)
- ``cpu_repack``: the cpu backend reads every weight as stored (no copy in ggml-cpu's repacked
  layout: :mod:`vkxsplit.backends.cpu`)
- ``cpu_amx``: the cpu backend copies no weight into ggml's AMX buffer type (Intel AMX tiles, in
  builds that have it); ``CPU_REPACK`` or the stored bytes instead
- ``ggml_llama``: the cpu backend loads the ``libggml-python`` wheel's ggml even where llama.cpp's
  own build (:data:`vkxsplit.backends.ggml_cpu.LLAMA_PACKAGE`) is installed and runs here

and one per fusion pass of the hub (:mod:`vkxsplit.fusion`, :data:`PASSES`):

- ``fuse_norm``: residual adds and the next RMSNorm stay two dispatches (no ``add_rms_norm``)
- ``fuse_rope``: the RoPE of K stays a ``rope`` node before the KV store
- ``fuse_q8``: the q8_1 x of decode mat-vecs comes from ``quantize_q8_1`` nodes only (no norm,
  SwiGLU or attention writes it)

A :class:`~vkxsplit.vk.device.Device` reads the variable once, when it is created
(``device.disabled``); every kernel choice reads that set. An unknown name is an error naming
the valid ones. Objects that stand in for a device (a physical device in ``vkxsplit info``,
test doubles) without a ``disabled`` attribute read the variable when asked.

Also here, because the cost profile is keyed by it: :class:`KernelInputs`, everything kernel
choice reads of a device (compute units, the workgroup and shared-memory limits, subgroup
sizes, the cooperative-matrix shapes, the enabled features, the disabled set), read once by
:func:`kernel_inputs`; :mod:`vkxsplit.ops.choose` derives the choices from it, and
:func:`kernel_config_ident` hashes it with the shipped SPIR-V.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import astuple, dataclass
from typing import Any

from .errors import VkxError

ENV = "VKXSPLIT_DISABLE"

#: feature name -> what switching it off does
FEATURES: dict[str, str] = {
    "coopmat": "no cooperative-matrix kernels: products over 8 rows take the tiled f32 kernel",
    "coopmat2": "mul_mat_coopmat where VK_NV_cooperative_matrix2 would run mul_mat_cm2",
    "intdot": "decode mat-vecs read f32 x (no q8_1 x, no integer dot products)",
    "dq16": "quantized products never dequantize the weights to f16 rows first",
    "splitk": "cooperative-matrix products never split K",
    "attn_coopmat": "prefill attention on the f32 tiled kernel (no cooperative-matrix attention)",
    "fusion": "the model graph without fused kernels (every fusion pass off)",
    "bf16_reduce": "the row split's all-reduce partials cross in f32 at every size (no bf16 compression)",
    "cpu_repack": "the cpu backend reads every weight as stored (no repacked copy in ggml-cpu's interleaved layout)",
    "cpu_amx": "the cpu backend copies no weight into ggml's AMX buffer type (the interleaved layout or as stored instead)",
    "ggml_llama": "the cpu backend loads the libggml-python wheel's ggml even where llama.cpp's build is installed and runs",
}

#: the fusion passes' switches (:mod:`vkxsplit.fusion`): name -> what switching it off does;
#: ``fusion`` switches all of them off
PASSES: dict[str, str] = {
    "fuse_norm": "residual add and the next RMSNorm as two dispatches (no add_rms_norm)",
    "fuse_rope": "the RoPE of K as its own node before the KV store",
    "fuse_q8": "decode's q8_1 x from quantize_q8_1 nodes only (not written by its producer)",
}

#: a switch that switches others off too
_GROUPS = {"fusion": frozenset(PASSES)}

#: the per-feature variables this one replaced; set, they are refused (with the new spelling)
#: rather than silently ignored
_REPLACED = {"VKXSPLIT_DISABLE_COOPMAT": "coopmat", "VKXSPLIT_DISABLE_COOPMAT2": "coopmat2",
             "VKXSPLIT_DISABLE_VECQ": "intdot", "VKXSPLIT_DISABLE_DQ16": "dq16",
             "VKXSPLIT_DISABLE_SPLITK": "splitk", "VKXSPLIT_DISABLE_FUSION": "fusion",
             "VKXSPLIT_DISABLE_VECQ_SG": None, "VKXSPLIT_DISABLE_VECQ_W5U": None,
             "VKXSPLIT_DISABLE_COOP_SHAPES": None}


def parse_disabled(value: str | None) -> frozenset[str]:
    """The feature names of a ``VKXSPLIT_DISABLE`` value; raises VkxError for an unknown one."""
    names = frozenset(n.strip().lower() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - FEATURES.keys() - PASSES.keys())
    if unknown:
        raise VkxError(f"{ENV}: unknown feature name(s) {', '.join(unknown)}",
                       f"valid names: {', '.join([*FEATURES, *PASSES])} (comma-separated)")
    return names


def disabled_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """``VKXSPLIT_DISABLE`` of ``environ`` (default: the process environment), parsed; a set
    variable of the per-feature kind this one replaced is refused, with its new spelling."""
    env = os.environ if environ is None else environ
    for old, new in _REPLACED.items():
        v = env.get(old)
        if v is not None and v.strip().lower() not in ("", "0", "false", "no", "off"):
            hint = (f"use {ENV}={new}" if new else
                    f"unset it (that tuning round's kernels are gone; {ENV} lists the switches)")
            raise VkxError(f"{old} is no longer read", hint)
    return parse_disabled(env.get(ENV))


def disabled(device: Any) -> frozenset[str]:
    """The features switched off for ``device``: its ``disabled`` set (a Device reads it once,
    when created); for an object without one (None, a physical device, a test double), the
    process's ``VKXSPLIT_DISABLE``."""
    got = getattr(device, "disabled", None)
    return disabled_from_env() if got is None else frozenset(got)


def is_disabled(device: Any, feature: str) -> bool:
    """Whether ``feature`` (a FEATURES or PASSES name) is switched off for ``device``: named
    itself, or a switch that covers it is (``fusion``: every pass)."""
    if feature not in FEATURES and feature not in PASSES:
        raise ValueError(f"unknown feature {feature!r}")
    off = disabled(device)
    return feature in off or any(feature in _GROUPS.get(n, ()) for n in off)


@dataclass(frozen=True)
class KernelInputs:
    """What kernel choice (:mod:`vkxsplit.ops.choose`) reads of a device, read once. ``None`` /
    0 where the object does not say (test doubles, drivers without the extension); the
    chooser's fallbacks apply then."""

    #: SMs (VK_NV_shader_sm_builtins) or AMD compute units; 0: not reported (lavapipe, Intel)
    compute_units: int = 0
    is_cpu: bool = False
    #: the host's cores where the device runs on them (a CPU device's compute units), else 0
    host_cores: int = 0
    #: maxComputeSharedMemorySize, maxComputeWorkGroupInvocations, maxComputeWorkGroupSize[0]
    #: (None: an object without limits)
    shared_memory: int | None = None
    workgroup_invocations: int | None = None
    workgroup_size_x: int | None = None
    #: maxComputeWorkgroupSubgroups (0: not reported)
    workgroup_subgroups: int = 0
    min_subgroup_size: int = 0
    max_subgroup_size: int = 0
    #: subgroup arithmetic in compute shaders (the mat-vec kernels' reduction)
    subgroup_arithmetic: bool = False
    #: the enabled features that are on
    features: frozenset[str] = frozenset()
    #: VkCooperativeMatrixPropertiesKHR as tuples (CoopMatShape's fields: m, n, k, a, b, c,
    #: result type, saturating, scope)
    coopmat_shapes: tuple[tuple[Any, ...], ...] = ()
    #: VK_NV_cooperative_matrix2 enabled, and its flexible workgroup-scope shapes (as tuples in
    #: CoopMatFlex's field order; None: an object without a physical device, every tiling)
    coopmat2: bool = False
    coopmat2_flex: tuple[tuple[Any, ...], ...] | None = ()
    disabled: frozenset[str] = frozenset()

    def ident(self) -> str:
        """A hash of every input (stable across processes)."""
        parts = [f"{k}={sorted(v) if isinstance(v, frozenset) else v!r}"
                 for k, v in zip(self.__dataclass_fields__, astuple(self), strict=True)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


_SUBGROUP_ARITHMETIC, _STAGE_COMPUTE = 0x4, 0x20


_SHAPE = ("m", "n", "k", "a_type", "b_type", "c_type", "result_type", "saturating", "scope")
_FLEX = ("m_granularity", "n_granularity", "k_granularity", "a_type", "b_type", "c_type", "result_type",
         "saturating", "scope", "workgroup_invocations")


def _tuple(x: Any, fields: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(getattr(x, f, None) for f in fields)


def kernel_inputs(device: Any) -> KernelInputs:
    """The :class:`KernelInputs` of ``device``: a :class:`~vkxsplit.vk.device.Device` (its
    physical device's properties and its enabled features), a physical device standing in for
    one (``vkxsplit info``), a test double (what it lacks counts as not reported), or None
    (nothing known: the cost model alone)."""
    off = disabled(device)
    phys = getattr(device, "physical", None)
    if phys is None and hasattr(device, "device_type"):
        phys = device  # a PhysicalDeviceInfo standing in for a device
    if phys is None:
        return KernelInputs(coopmat2_flex=None, disabled=off)
    feats = getattr(device, "features", None)
    if feats is None:
        feats = getattr(phys, "features", None) or {}
    cpu = getattr(device, "is_cpu", None)
    if cpu is None:
        cpu = getattr(phys, "is_cpu", False)
    lim = getattr(phys, "limits", None) or {}
    size = lim.get("maxComputeWorkGroupSize")
    return KernelInputs(
        compute_units=int(getattr(phys, "compute_units", 0) or 0), is_cpu=bool(cpu),
        host_cores=(os.cpu_count() or 1) if cpu else 0,
        shared_memory=lim.get("maxComputeSharedMemorySize") if lim else None,
        workgroup_invocations=lim.get("maxComputeWorkGroupInvocations") if lim else None,
        workgroup_size_x=None if size is None else int(size[0]),
        workgroup_subgroups=int(getattr(phys, "max_workgroup_subgroups", 0) or 0),
        min_subgroup_size=int(getattr(phys, "min_subgroup_size", 0) or 0),
        max_subgroup_size=int(getattr(phys, "max_subgroup_size", 0) or 0),
        subgroup_arithmetic=bool(getattr(phys, "subgroup_ops", 0) & _SUBGROUP_ARITHMETIC
                                 and getattr(phys, "subgroup_stages", 0) & _STAGE_COMPUTE),
        features=frozenset(k for k, v in feats.items() if v),
        coopmat_shapes=tuple(_tuple(s, _SHAPE) for s in getattr(phys, "coopmat_shapes", ()) or ()),
        coopmat2=bool(getattr(device, "coopmat2", False)),
        coopmat2_flex=tuple(_tuple(f, _FLEX) for f in getattr(phys, "coopmat2_flex", ()) or ()),
        disabled=off)


def kernel_config_ident(device: Any) -> str:
    """A hash of what decides which kernels ``device`` runs: the shipped SPIR-V (every module's
    name and hash) and the device's :class:`KernelInputs` (compute units, limits, subgroup
    sizes, cooperative-matrix shapes, enabled features, the features switched off for it).
    A cost profile measured under one configuration does not apply to another (vkxsplit.plan
    keys profiles with it)."""
    from .shaders import manifest_ident

    h = hashlib.sha256(manifest_ident().encode())
    h.update(("disabled=" + ",".join(sorted(disabled(device)))).encode())
    h.update(("inputs=" + kernel_inputs(device).ident()).encode())
    return h.hexdigest()[:16]


__all__ = ["ENV", "FEATURES", "PASSES", "KernelInputs", "disabled", "disabled_from_env", "is_disabled",
           "kernel_config_ident", "kernel_inputs", "parse_disabled"]
