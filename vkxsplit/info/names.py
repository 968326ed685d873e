"""Names for Vulkan numbers in the ``info`` report: queue, memory and subgroup flags, device
types, vendors, cooperative-matrix component types and scopes (static tables, so that nothing
here needs the Vulkan loader to be importable; only :func:`_enum_names` reads the ``vulkan``
package's constants, when called), and the formats of versions and UUIDs.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..vk.result import version_str as _vk_version

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


def driver_version_str(vendor_id: int, v: int) -> str:
    """The driver version as vulkaninfo decodes it (NVIDIA packs it differently)."""
    if vendor_id == 0x10DE:
        return f"{v >> 22 & 0x3FF}.{v >> 14 & 0xFF}.{v >> 6 & 0xFF}.{v & 0x3F}"
    return _vk_version(v)


def _uuid(b: bytes) -> str:
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else h


def _enum_names(prefix: str) -> dict[int, str]:
    """value -> name for the ``vulkan`` package's constants with ``prefix`` (first, shortest name)."""
    from ..vk.api import vk

    out: dict[int, str] = {}
    for n in sorted(dir(vk), key=len):
        if n.startswith(prefix) and "__" not in n:
            v = getattr(vk, n)
            if isinstance(v, int) and v not in out:
                out[v] = n
    return out
