"""Kernel choice (vkxsplit/ops/choose.py): made once per device from its queried properties.

The pinned tables were recorded with the choosers as they were inside ops/mul_mat.py before the
choice moved (module-level functions with the H200's constants: COOP_WAVE = 128, CM2_WAVE = 132,
COOP_SHARED_MAX = 49152), for a fake H200 (132 SMs, 48 KiB of shared memory, 1024 invocations,
subgroup size 32, VK_NV_cooperative_matrix2) under each kill switch, and for lavapipe: every
(type, M, N, K) of the grid below (the three benchmark models' shapes, smol135m / llama1b /
llama8b, and the tests' shapes) must choose the same path, variant, split and dequantize-first
as then. ``DIGESTS`` pins the whole grid (the sha256 of its sorted ``key=choice`` lines),
``PINNED`` a readable part of it. The types added later (Q2_K, Q3_K, IQ4_NL, IQ4_XS) have their
own digests (``NEW_DIGESTS``), so the old types' tables stay as they were; they choose as their
nearest measured type does (``NEAREST``), but for what they lack (no q8_1-x decode kernel, no
lane choice) and the dequantize-first model's pass bytes (their rows are smaller).
"""

from __future__ import annotations

import hashlib
import types

import pytest

from vkxsplit import features
from vkxsplit.errors import KernelError
from vkxsplit.ops import choose
from vkxsplit.ops import mul_mat as mm
from vkxsplit.ops.choose import kernels_for
from vkxsplit.vk import instance as vki
from vkxsplit.vk.api import vk

CM2_FEATS = ("cooperativeMatrix", "cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
             "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads", "bufferDeviceAddress",
             "shaderFloat16", "vulkanMemoryModel", "storageBuffer16BitAccess", "storageBuffer8BitAccess",
             "subgroupSizeControl", "shaderIntegerDotProduct")
#: what lavapipe (Mesa 22.3, LLVM 15) enables
LAVAPIPE_FEATS = ("computeFullSubgroups", "maintenance4", "scalarBlockLayout", "shaderBufferInt64Atomics",
                  "shaderFloat16", "shaderFloat64", "shaderInt16", "shaderInt64", "shaderInt8",
                  "shaderIntegerDotProduct", "storageBuffer16BitAccess", "storageBuffer8BitAccess",
                  "storagePushConstant8", "subgroupSizeControl", "synchronization2", "timelineSemaphore",
                  "uniformAndStorageBuffer16BitAccess", "uniformAndStorageBuffer8BitAccess", "vulkanMemoryModel",
                  "vulkanMemoryModelDeviceScope")


def fake_h200(disabled=(), units=132, shared=49152):
    """An object standing in for a Device on an H200: its compute units, limits, subgroup size,
    coopmat shape and coopmat2 flexible shapes (as vkxsplit queries them)."""
    feats = dict.fromkeys(CM2_FEATS, True)
    phys = types.SimpleNamespace(
        name="fake H200", device_type=vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU, is_cpu=False, compute_units=units,
        limits={"maxComputeSharedMemorySize": shared, "maxComputeWorkGroupInvocations": 1024,
                "maxComputeWorkGroupSize": (1024, 1024, 64)},
        subgroup_size=32, min_subgroup_size=32, max_subgroup_size=32, max_workgroup_subgroups=32,
        subgroup_ops=0xff, subgroup_stages=0x20, features=feats,
        coopmat_shapes=[vki.CoopMatShape(16, 16, 16, 0, 0, 1, 1, False, 3)],
        coopmat2={"cooperativeMatrixWorkgroupScopeMaxWorkgroupSize": 256},
        coopmat2_flex=[vki.CoopMatFlex(16, 16, 16, 0, 0, 1, 1, False, 2, n) for n in (256, 128)])
    return types.SimpleNamespace(name="fake H200", physical=phys, features=dict(feats), coopmat2=True,
                                 disabled=frozenset(disabled), is_cpu=False)


def fake_lavapipe(disabled=()):
    feats = dict.fromkeys(LAVAPIPE_FEATS, True)
    phys = types.SimpleNamespace(
        name="fake llvmpipe", device_type=vk.VK_PHYSICAL_DEVICE_TYPE_CPU, is_cpu=True, compute_units=0,
        limits={"maxComputeSharedMemorySize": 32768, "maxComputeWorkGroupInvocations": 1024,
                "maxComputeWorkGroupSize": (1024, 1024, 1024)},
        subgroup_size=8, min_subgroup_size=8, max_subgroup_size=8, max_workgroup_subgroups=32,
        subgroup_ops=0xbf, subgroup_stages=0x30, features=feats, coopmat_shapes=[], coopmat2={}, coopmat2_flex=[])
    return types.SimpleNamespace(name="fake llvmpipe", physical=phys, features=dict(feats), coopmat2=False,
                                 disabled=frozenset(disabled), is_cpu=True)


TYPES = ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]
MS = (1, 2, 3, 8, 9, 64, 128, 129, 256, 300, 512, 1024, 2048, 4096, 8192)
#: (N, K): smol135m, llama1b, llama8b (q, k/v, gate/up, down, output), then the tests' shapes
NKS = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576),
       (2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (32000, 2048),
       (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (32000, 4096),
       (128256, 4096), (100, 1536), (128, 1024), (1000, 1024))
CONFIGS = {"h200": lambda: fake_h200(), "h200-coopmat2": lambda: fake_h200({"coopmat2"}),
           "h200-splitk": lambda: fake_h200({"splitk"}), "h200-dq16": lambda: fake_h200({"dq16"}),
           "h200-intdot": lambda: fake_h200({"intdot"}), "h200-coopmat": lambda: fake_h200({"coopmat"}),
           "lavapipe": lambda: fake_lavapipe()}


def choice(dev, t: str, M: int, N: int, K: int, addressable: bool = True) -> str:
    """What record_mul_mat (and a graph's decode mat-vec) runs for this product on ``dev``:
    ``vec <f32-x variant> <q8_1-x variant or None>``, ``tiled <variant>`` or ``coopmat
    <variant> <K per split> <dq16>`` (``addressable``: the weights' block has device
    addresses; False: an exported or imported block)."""
    mm.check_mul_mat(t, M, N, K, device=dev)  # raises for shapes no kernel takes
    kc = kernels_for(dev)
    path = kc.path(M)
    if path == "vec":
        q = kc.vecq(t, M)
        return f"vec {kc.matvec(t, M)} {None if q is None else kc.vecq_for_shape(q, t, N, K)}"
    if path == "tiled":
        return f"tiled mul_mat_{t}_f32"
    v, ks, dq = kc.matmat(t, M, N, K, addressable=addressable)
    return f"coopmat {v} {ks} {int(dq)}"


def table(dev, shared: bool, types: list[str] = TYPES) -> dict[str, str]:
    out = {}
    for t in types:
        for M in MS:
            for N, K in NKS:
                key = f"{t} {M} {N} {K}"
                try:
                    out[key] = choice(dev, t, M, N, K)
                    if shared:
                        out[key + " shared"] = choice(dev, t, M, N, K, addressable=False)
                except KernelError:
                    out[key] = "error KernelError"
    return out


def digest(tab: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(tab.items())).encode()).hexdigest()[:32]


PINNED = {
    "h200": {
        "q4_0 1 4096 4096": "vec mul_mat_vec_q4_0_f32_m1 mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr1_u2_r2_sg_w5u",
        "q4_0 1 14336 4096": "vec mul_mat_vec_q4_0_f32_m1 mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr2_r4_w5u",
        "q4_0 1 4096 14336": "vec mul_mat_vec_q4_0_f32_m1 mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr1_u2_r2_sg_w5u",
        "q4_0 128 4096 4096": "coopmat mul_mat_cm2_q4_0_f32_w64x128_k64_n128 1024 0",
        "q4_0 128 14336 4096": "coopmat mul_mat_cm2_q4_0_f32_w64x128_k64_n128 0 0",
        "q4_0 128 4096 14336": "coopmat mul_mat_cm2_q4_0_f32_w64x128_k64_n128 3584 0",
        "q4_0 512 4096 4096": "coopmat mul_mat_cm2_f16_f32_w128x128_k64_n256 0 1",
        "q4_0 512 14336 4096": "coopmat mul_mat_cm2_f16_f32_w128x256_k64_n256 0 1",
        "q4_0 512 4096 14336": "coopmat mul_mat_cm2_f16_f32_w128x256_k64_n256 7168 1",
        "q4_k 1 4096 4096": "vec mul_mat_vec_q4_k_f32_m1 mul_mat_vecq_q4_k_q8_1_m1_b1_wg128_nr2_u2_s4",
        "q4_k 1 14336 4096": "vec mul_mat_vec_q4_k_f32_m1 mul_mat_vecq_q4_k_q8_1_m1_b1_wg128_nr2_u2_s4",
        "q4_k 1 4096 14336": "vec mul_mat_vec_q4_k_f32_m1 mul_mat_vecq_q4_k_q8_1_m1_b1_wg128_nr2_u2_s4",
        "q4_k 128 4096 4096": "coopmat mul_mat_cm2_q4_k_f32_w128x128_k64_n256 1024 0",
        "q4_k 128 14336 4096": "coopmat mul_mat_cm2_q4_k_f32_w128x128_k64_n256 0 0",
        "q4_k 128 4096 14336": "coopmat mul_mat_cm2_q4_k_f32_w128x128_k64_n256 3584 0",
        "q4_k 512 4096 4096": "coopmat mul_mat_cm2_f16_f32_w128x128_k64_n256 0 1",
        "q4_k 512 14336 4096": "coopmat mul_mat_cm2_f16_f32_w128x256_k64_n256 0 1",
        "q4_k 512 4096 14336": "coopmat mul_mat_cm2_f16_f32_w128x256_k64_n256 7168 1",
        "f16 1 4096 4096": "vec mul_mat_vec_f16_f32_m1 None",
        "f16 1 14336 4096": "vec mul_mat_vec_f16_f32_m1 None",
        "f16 1 4096 14336": "vec mul_mat_vec_f16_f32_m1 None",
        "f16 128 4096 4096": "coopmat mul_mat_cm2_f16_f32_w128x128_k64_n256 1024 0",
        "f16 128 14336 4096": "coopmat mul_mat_cm2_f16_f32_w128x128_k64_n256 0 0",
        "f16 128 4096 14336": "coopmat mul_mat_cm2_f16_f32_w128x128_k64_n256 3584 0",
        "f16 512 4096 4096": "coopmat mul_mat_cm2_f16_f32_w128x128_k64_n256 0 0",
        "f16 512 14336 4096": "coopmat mul_mat_cm2_f16_f32_w128x256_k64_n256 0 0",
        "f16 512 4096 14336": "coopmat mul_mat_cm2_f16_f32_w128x256_k64_n256 7168 0",
    },
    "h200-coopmat2": {
        "q4_0 128 4096 4096": "coopmat mul_mat_coopmat_q4_0_f32 1024 0",
        "q4_0 128 14336 4096": "coopmat mul_mat_coopmat_q4_0_f32 0 0",
        "q4_0 128 4096 14336": "coopmat mul_mat_coopmat_q4_0_f32 3584 0",
        "q4_0 512 4096 4096": "coopmat mul_mat_coopmat_q4_0_f32_t256x128_k32_w64x64_s1 2048 0",
        "q4_0 512 14336 4096": "coopmat mul_mat_coopmat_q4_0_f32_t256x128_k32_w64x64_s1 0 0",
        "q4_0 512 4096 14336": "coopmat mul_mat_coopmat_q4_0_f32_t256x128_k32_w64x64_s1 7168 0",
        "f16 128 4096 4096": "coopmat mul_mat_coopmat_f16_f32 1024 0",
        "f16 128 14336 4096": "coopmat mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1 2048 0",
        "f16 128 4096 14336": "coopmat mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1 1792 0",
        "f16 512 4096 4096": "coopmat mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1 2048 0",
        "f16 512 14336 4096": "coopmat mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1 0 0",
        "f16 512 4096 14336": "coopmat mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1 7168 0",
    },
    "lavapipe": {
        "q4_0 1 4096 4096": "vec mul_mat_vec_q4_0_f32_m1_wg32_nr4_u1_l4 mul_mat_vecq_q4_0_q8_1_m1_b1_wg64_nr64",
        "q4_0 1 14336 4096": "vec mul_mat_vec_q4_0_f32_m1_wg32_nr4_u1_l4 mul_mat_vecq_q4_0_q8_1_m1_b1_wg64_nr64",
        "q4_0 2 4096 4096": "vec mul_mat_vec_q4_0_f32_m2 None",
        "q4_0 2 14336 4096": "vec mul_mat_vec_q4_0_f32_m2 None",
        "q4_0 512 4096 4096": "tiled mul_mat_q4_0_f32",
        "q4_0 512 14336 4096": "tiled mul_mat_q4_0_f32",
        "q6_k 1 4096 4096": "vec mul_mat_vec_q6_k_f32_m1_wg32_nr2_u1 mul_mat_vecq_q6_k_q8_1_m1_b1_wg64_nr64",
        "q6_k 1 14336 4096": "vec mul_mat_vec_q6_k_f32_m1_wg32_nr2_u1 mul_mat_vecq_q6_k_q8_1_m1_b1_wg64_nr64",
        "q6_k 2 4096 4096": "vec mul_mat_vec_q6_k_f32_m2 None",
        "q6_k 2 14336 4096": "vec mul_mat_vec_q6_k_f32_m2 None",
        "q6_k 512 4096 4096": "tiled mul_mat_q6_k_f32",
        "q6_k 512 14336 4096": "tiled mul_mat_q6_k_f32",
        "f16 1 4096 4096": "vec mul_mat_vec_f16_f32_m1_wg128_nr8_u1 None",
        "f16 1 14336 4096": "vec mul_mat_vec_f16_f32_m1_wg128_nr8_u1 None",
        "f16 2 4096 4096": "vec mul_mat_vec_f16_f32_m2 None",
        "f16 2 14336 4096": "vec mul_mat_vec_f16_f32_m2 None",
        "f16 512 4096 4096": "tiled mul_mat_f16_f32",
        "f16 512 14336 4096": "tiled mul_mat_f16_f32",
    },
}
#: the weight types added after the tables above, and the measured type each was modelled on
NEAREST = {"q2_k": "q6_k", "q3_k": "q6_k", "iq4_nl": "q4_0", "iq4_xs": "q4_k"}
NEW_DIGESTS = {
    "h200": "7825dfce99507b249aa56b4cef44476b",
    "h200-coopmat": "a3ec3cbe1cbe259c962e3c84e0f31a5c",
    "h200-coopmat2": "f24fc171a57c8340b2d8f2a9614c3a02",
    "h200-dq16": "68dc0efab4da47d428a2fdff5d13276f",
    "h200-intdot": "7825dfce99507b249aa56b4cef44476b",
    "h200-splitk": "39c0052ce3ec95af146b8892f9e8b7ac",
    "lavapipe": "e6be0a2cfc97dbb3206bebed32f3e9c2",
}
DIGESTS = {
    "h200": "1aa6bedccece5f0d52d8642dba637cf9",
    "h200-coopmat": "b46998cd699768ea94537eb1bd931b39",
    "h200-coopmat2": "a6e12095c52d8ed1f5053164945b24ec",
    "h200-dq16": "fd0cab77ac57d0c0ce838f6799712c6e",
    "h200-intdot": "77d22e01e58e4c94526f61acbc0bb462",
    "h200-splitk": "a62287bddf903314a1b0abdc41d2f8c9",
    "lavapipe": "77860a607235bf8174bf1b767f04dd52",
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_pinned_choices(config, monkeypatch):
    """The H200's and lavapipe's choices for the grid are what the choosers in ops/mul_mat.py
    chose before the choice moved to ops/choose.py (the digest of the whole grid, and a
    readable part)."""
    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)
    tab = table(CONFIGS[config](), shared=not config.startswith("lavapipe"))
    for key, want in PINNED.get(config, {}).items():
        assert tab[key] == want, (config, key)
    assert digest(tab) == DIGESTS[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_new_types_choose_as_their_nearest_type(config, monkeypatch):
    """Q2_K / Q3_K choose as Q6_K, IQ4_NL as Q4_0, IQ4_XS as Q4_K over the whole grid (pinned by
    NEW_DIGESTS), but: decode reads f32 x (no q8_1-x variant) with the type's mat-vec shape
    without a lane choice, and where the dequantize-first model's choice differs it is dq16 for
    the type with the smaller rows (the pass reads fewer bytes)."""
    from vkxsplit.ops.quant import row_bytes

    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)
    dev = CONFIGS[config]()
    shared = not config.startswith("lavapipe")
    new = table(dev, shared, list(NEAREST))
    assert digest(new) == NEW_DIGESTS[config]
    old = table(dev, shared, sorted(set(NEAREST.values())))
    dq16_differs = 0
    for key, got in new.items():
        t = key.split()[0]
        n = NEAREST[t]
        want = old[n + key[len(t):]].replace(f"_{n}_", f"_{t}_")
        kind = got.split()[0]
        assert kind == want.split()[0], (config, key)
        if kind == "vec":
            f32x, q8x = got.split()[1:]
            assert q8x == "None" and f32x == want.split()[1].removesuffix("_l4").removesuffix("_l8"), (key, got)
        elif got != want:  # coopmat: only the dq16 model's pick may differ
            g, w = got.split(), want.split()
            assert g[3] == "1" and w[3] == "0", (config, key, got, want)
            K = int(key.split()[3])
            assert row_bytes(t, K) < row_bytes(n, K)
            dq16_differs += 1
    assert dq16_differs <= len(new) // 50  # the borderline shapes only


def test_this_device_chooses_as_its_pinned_kind(device):
    """This machine's device (lavapipe in CI, the lent H200 on the device machine) chooses as
    the fake of its kind does, for the grid's llama8b shapes: the fakes stand for what the
    real devices report."""
    if device.disabled or not (device.is_cpu or "H200" in device.name):
        pytest.skip("kill switches set, or a device without a pinned table")
    fake = fake_lavapipe() if device.is_cpu else fake_h200()
    for t in TYPES:
        for M in (1, 2, 8, 9, 512):
            for N, K in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)):
                assert choice(device, t, M, N, K) == choice(fake, t, M, N, K), (t, M, N, K)


def test_inputs_come_from_the_device():
    """The wave sizes are the compute units' (132 on the H200: a coopmat wave of 128, a cm2
    wave of 132), the shared-memory limit is the device's, a CPU device counts host cores, and
    a GPU that does not report its units counts as an H200."""
    import os

    h = kernels_for(fake_h200())
    assert (h.compute_units, h.coop_wave, h.cm2_wave, h.shared_max) == (132, 128, 132, 49152)
    assert (h.coopmat, h.coopmat2, h.intdot, h.vec, h.is_cpu) == (True, True, True, True, False)
    assert h.cm2_tiles == frozenset(mm.CM2_TILES)
    other = kernels_for(fake_h200(units=66, shared=65536))
    assert (other.compute_units, other.coop_wave, other.cm2_wave, other.shared_max) == (66, 64, 66, 65536)
    assert kernels_for(fake_h200(units=0)).compute_units == choose.DEFAULT_COMPUTE_UNITS
    lp = kernels_for(fake_lavapipe())
    assert lp.compute_units == (os.cpu_count() or 1) and lp.is_cpu and lp.decode_workgroups == lp.compute_units
    assert (lp.coopmat, lp.coopmat2, lp.intdot, lp.vec, lp.shared_max) == (False, False, True, True, 32768)
    # no device: the cost model alone, with the fallbacks
    none = kernels_for(None)
    assert (none.compute_units, none.coop_wave, none.shared_max, none.cm2_tiles) == (132, 128, 49152, None)


def test_compute_units_change_the_split():
    """The wave model uses the device's unit count: M = 128, N = 4096, K = 4096 is 32 tiles of
    128 x 128; with a wave of 128 (132 units) 4 ranges fill one wave (1024 + 256 per group),
    with a wave of 64 (66 units) 2 ranges do (2048 + 256 = 2304 < 2 waves of 1280)."""
    tile = mm.COOP_TILES[mm.COOP_CONFIG["q4_0"]]
    assert kernels_for(fake_h200()).coop_k_split(tile, 128, 4096, 4096) == 1024
    assert kernels_for(fake_h200(units=66)).coop_k_split(tile, 128, 4096, 4096) == 2048
    assert kernels_for(fake_h200({"coopmat2"}, units=66)).matmat("q4_0", 128, 4096, 4096) == (
        "mul_mat_coopmat_q4_0_f32", 2048, False)
    # mul_mat_cm2's wave is the unit count too
    assert kernels_for(fake_h200()).cm2("q4_0", 128, 4096, 4096) == ("mul_mat_cm2_q4_0_f32_w64x128_k64_n128", 1024)
    assert kernels_for(fake_h200(units=66)).cm2("q4_0", 128, 4096, 4096) == (
        "mul_mat_cm2_q4_0_f32_w64x128_k64_n128", 2048)


def test_shared_memory_limits_the_tilings():
    """A large tiling is not taken where the device's shared memory is too small for it (the
    f16 one needs 46 KiB, the quantized one 38 KiB: 45 KiB takes only the quantized one), and
    with less than the default tiling's 44 KiB there is no coopmat path at all."""
    big = kernels_for(fake_h200({"coopmat2"}))
    assert big.coop("f16", 512, 14336, 4096) == ("mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1", 0)
    small = kernels_for(fake_h200({"coopmat2"}, shared=45 * 1024))
    assert small.coopmat_available and not small.tile_fits(mm.COOP_TILES["t128x256_k32_w32x64_s1"])
    assert small.coop("f16", 512, 14336, 4096) == ("mul_mat_coopmat_f16_f32", 2048)
    assert small.coop("q4_0", 512, 14336, 4096)[0] == "mul_mat_coopmat_q4_0_f32_t256x128_k32_w64x64_s1"
    tiny = kernels_for(fake_h200({"coopmat2"}, shared=32768))
    assert not tiny.coopmat and tiny.path(512) == "tiled" and tiny.path(8) == "vec"


def test_choice_is_made_once_per_device():
    """kernels_for keeps one object per device (weakly: it goes with the device), rebuilt only
    where the device's disabled set changed (tests set it)."""
    class Dev:
        def __init__(self):
            self.physical = fake_h200().physical
            self.features, self.coopmat2, self.is_cpu = dict(self.physical.features), True, False
            self.disabled = frozenset()

    d = Dev()
    first = kernels_for(d)
    assert kernels_for(d) is first and first.coopmat2_available
    d.disabled = frozenset({"coopmat2"})
    again = kernels_for(d)
    assert again is not first and not again.coopmat2_available and again.coopmat_available
    assert kernels_for(d) is again
    with pytest.raises(AttributeError):
        again.coop_wave = 1  # frozen


def test_kernel_config_ident_hashes_the_choice_inputs(monkeypatch):
    """The cost profile's kernel key changes with what kernel choice reads of the device
    (compute units, shared memory, the disabled set, ...) and not otherwise."""
    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)
    base = features.kernel_config_ident(fake_h200())
    assert features.kernel_config_ident(fake_h200()) == base
    others = {features.kernel_config_ident(d) for d in (
        fake_h200(units=108), fake_h200(shared=65536), fake_h200({"splitk"}), fake_lavapipe())}
    assert len(others) == 4 and base not in others
    assert kernels_for(fake_h200()).ident() == features.kernel_inputs(fake_h200()).ident()
    assert kernels_for(fake_h200(units=108)).ident() != kernels_for(fake_h200()).ident()


def test_device_is_cpu(device):
    assert device.is_cpu == (device.physical.device_type == vk.VK_PHYSICAL_DEVICE_TYPE_CPU)
    assert kernels_for(device).is_cpu == device.is_cpu
