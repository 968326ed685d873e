"""Kill switches: one per kernel feature, for bisecting a suspected kernel or comparing paths.

``VKXSPLIT_DISABLE`` is a comma-separated list of feature names (case and spaces ignored):

- ``coopmat``: no cooperative-matrix kernels; products over 8 rows take the tiled f32 kernel
  (and so neither ``mul_mat_cm2`` nor dequantize-first runs)
- ``coopmat2``: the subgroup-scope ``mul_mat_coopmat`` where VK_NV_cooperative_matrix2 would
  run ``mul_mat_cm2`` (and so no dequantize-first)
- ``intdot``: decode mat-vecs read x as f32 (no q8_1 x, no integer dot products)
- ``dq16``: quantized products never dequantize the weights to f16 rows first
- ``splitk``: cooperative-matrix products never split K
- ``fusion``: the model graph without fused kernels (residual add + RMSNorm, RoPE of K + KV
  store, the norms and SwiGLU writing q8_1 x)

A :class:`~vkxsplit.vk.device.Device` reads the variable once, when it is created
(``device.disabled``); every kernel choice reads that set. An unknown name is an error naming
the valid ones. Objects that stand in for a device (a physical device in ``vkxsplit info``,
test doubles) without a ``disabled`` attribute read the variable when asked.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
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
    "fusion": "the model graph without fused kernels",
}

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
    unknown = sorted(names - FEATURES.keys())
    if unknown:
        raise VkxError(f"{ENV}: unknown feature name(s) {', '.join(unknown)}",
                       f"valid names: {', '.join(FEATURES)} (comma-separated)")
    return names


def disabled_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """``VKXSPLIT_DISABLE`` of ``environ`` (default: the process environment), parsed; a set
    variable of the per-feature kind this one replaced is refused, with its new spelling."""
    env = os.environ if environ is None else environ
    for old, new in _REPLACED.items():
        v = env.get(old)
        if v is not None and v.strip().lower() not in ("", "0", "false", "no", "off"):
            what = f"{ENV}={new}" if new else f"nothing (that tuning round's kernels are gone; {ENV} lists the switches)"
            raise VkxError(f"{old} is no longer read", f"use {what}")
    return parse_disabled(env.get(ENV))


def disabled(device: Any) -> frozenset[str]:
    """The features switched off for ``device``: its ``disabled`` set (a Device reads it once,
    when created); for an object without one (None, a physical device, a test double), the
    process's ``VKXSPLIT_DISABLE``."""
    got = getattr(device, "disabled", None)
    return disabled_from_env() if got is None else frozenset(got)


def is_disabled(device: Any, feature: str) -> bool:
    """Whether ``feature`` (a FEATURES name) is switched off for ``device``."""
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}")
    return feature in disabled(device)


def kernel_config_ident(device: Any) -> str:
    """A hash of what decides which kernels ``device`` runs: the shipped SPIR-V (every module's
    name and hash) and the features switched off for it. A cost profile measured under one
    configuration does not apply to another (vkxsplit.plan keys profiles with it)."""
    from .shaders import manifest_ident

    h = hashlib.sha256(manifest_ident().encode())
    h.update(("disabled=" + ",".join(sorted(disabled(device)))).encode())
    return h.hexdigest()[:16]


__all__ = ["ENV", "FEATURES", "disabled", "disabled_from_env", "is_disabled", "kernel_config_ident",
           "parse_disabled"]
