"""The Vulkan instance, the validation layer, and physical-device discovery.

``Instance`` owns the VkInstance and (when validation is on) the debug messenger whose
messages are collected in ``Instance.messages``; the test suite fails on any of them.
``PhysicalDeviceInfo`` is a plain-Python snapshot of what a device offers (properties,
extensions, features, memory, queues) so the rest of vkxsplit never re-queries the driver.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cffi

from ..errors import EnvironmentProblem, VkxError
from .api import API_1_2, API_1_3, NULL, check, cstr, enumerate_, ffi, lib, new, string, version_str, vk

log = logging.getLogger("vkxsplit.vk")

VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"

# VK_KHR_shader_bfloat16 is newer than the `vulkan` package's headers: its feature struct is
# declared here from the registry (sType 1000141000, three VkBool32 after the header).
STYPE_BFLOAT16_FEATURES = 1000141000
try:
    ffi.cdef("""
    typedef struct VkxBf16Features {
        VkStructureType sType;
        void* pNext;
        VkBool32 shaderBFloat16Type;
        VkBool32 shaderBFloat16DotProduct;
        VkBool32 shaderBFloat16CooperativeMatrix;
    } VkxBf16Features;
    """)
except Exception:  # already declared (module reloaded)
    pass

# The `vulkan` package's ffi is compiled out of line: it has no cdef, so the declaration above
# never takes effect. The struct lives in its own FFI and is chained by address instead.
_bf16_ffi = cffi.FFI()
_bf16_ffi.cdef("""
typedef struct VkxBf16Features {
    int32_t sType;
    void* pNext;
    uint32_t shaderBFloat16Type;
    uint32_t shaderBFloat16DotProduct;
    uint32_t shaderBFloat16CooperativeMatrix;
} VkxBf16Features;
""")


# VK_NV_cooperative_matrix2 (extension 594), also newer than the package's headers: its
# feature and property structs and the flexible-dimensions query, declared from the registry.
STYPE_COOPMAT2_FEATURES = 1000593000
STYPE_COOPMAT_FLEX_PROPERTIES = 1000593001
STYPE_COOPMAT2_PROPERTIES = 1000593002
COOPMAT2_FEATURES = ("cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                     "cooperativeMatrixReductions", "cooperativeMatrixConversions",
                     "cooperativeMatrixPerElementOperations", "cooperativeMatrixTensorAddressing",
                     "cooperativeMatrixBlockLoads")
COOPMAT2_PROPERTIES = ("cooperativeMatrixWorkgroupScopeMaxWorkgroupSize",
                       "cooperativeMatrixFlexibleDimensionsMaxDimension",
                       "cooperativeMatrixWorkgroupScopeReservedSharedMemory")
_bf16_ffi.cdef(
    "typedef struct VkxCoopmat2Features { int32_t sType; void* pNext; "
    + " ".join(f"uint32_t {f};" for f in COOPMAT2_FEATURES) + " } VkxCoopmat2Features;\n"
    "typedef struct VkxCoopmat2Properties { int32_t sType; void* pNext; "
    + " ".join(f"uint32_t {f};" for f in COOPMAT2_PROPERTIES) + " } VkxCoopmat2Properties;\n"
    """typedef struct VkxCoopFlexProperties {
    int32_t sType; void* pNext;
    uint32_t MGranularity; uint32_t NGranularity; uint32_t KGranularity;
    int32_t AType; int32_t BType; int32_t CType; int32_t ResultType;
    uint32_t saturatingAccumulation; int32_t scope; uint32_t workgroupInvocations;
} VkxCoopFlexProperties;
typedef int32_t (*VkxPfnCoopFlex)(void* physicalDevice, uint32_t* count, VkxCoopFlexProperties* props);
""")


def raw_struct(ctype: str, stype: int) -> tuple[Any, Any]:
    """A struct of the extensions declared here (VkxCoopmat2Features, ...): (the struct, a
    ``void*`` to it for pNext chains of the vulkan ffi). Chain them after every vulkan-ffi
    struct (their own pNext is of this ffi: use :func:`link_raw`)."""
    s = _bf16_ffi.new(f"{ctype}*")
    s.sType = stype
    return s, ffi.cast("void*", int(_bf16_ffi.cast("uintptr_t", s)))


def link_raw(first: Any, second: Any) -> None:
    """first.pNext = second, both structs of this module's own ffi."""
    first.pNext = _bf16_ffi.cast("void*", second)


def chain_raw(tail: Any, raw: list[Any]) -> None:
    """Append (struct, void*) pairs of this module's ffi to a vulkan-ffi chain ending at ``tail``."""
    for i, (s, ptr) in enumerate(raw):
        if i == 0:
            tail.pNext = ptr
        else:
            link_raw(raw[i - 1][0], s)


def new_bf16_features() -> tuple[Any, Any]:
    """A VkPhysicalDeviceShaderBfloat16FeaturesKHR: (the struct, a ``void*`` to it for pNext
    chains built with the vulkan ffi). Keep the struct alive while the chain is used; put it
    last in a chain (its own pNext is of the other ffi)."""
    return raw_struct("VkxBf16Features", STYPE_BFLOAT16_FEATURES)


# Validation layers older than an extension (Debian 12 ships 1.3.239; VK_KHR_cooperative_matrix
# came with 1.3.255) first say "Device Extension X is not supported by this layer", then report
# X's feature structures as unknown sTypes and X's SPIR-V capability/extension as unsupported:
# findings about the layer's blind spot, not about our use. After the layer said it does not
# know X, messages carrying one of X's markers below are not counted. (The shipped SPIR-V still
# passes spirv-val for its target environment at build time: tests/test_shaders.py.)
# A module with specialization constants is specialized by the layer's own spirv-opt, which
# fails on the capability it does not know (the message does not name it).
_SPEC_OPT_FAILED = "attempted to apply specialization constants with spirv-opt but failed"
_LAYER_DOES_NOT_KNOW = re.compile(r"Device Extension (VK_\w+) is not supported by this layer")
_BLIND_SPOT_MARKERS: dict[str, tuple[str, ...]] = {
    "VK_KHR_cooperative_matrix": (
        "unknown VkStructureType (1000506000)",   # VkPhysicalDeviceCooperativeMatrixFeaturesKHR
        "SPV_KHR_cooperative_matrix",             # OpExtension
        "Invalid capability operand: 6022",       # CooperativeMatrixKHR
        "A SPIR-V Capability (Unhandled OpCapability) was declared",  # the same capability, unnamed
        _SPEC_OPT_FAILED,
    ),
    "VK_KHR_shader_bfloat16": (
        "unknown VkStructureType (1000141000)",   # VkPhysicalDeviceShaderBfloat16FeaturesKHR
    ),
    "VK_NV_cooperative_matrix2": (
        "unknown VkStructureType (1000593000)",   # VkPhysicalDeviceCooperativeMatrix2FeaturesNV
        "unknown VkStructureType (1000593002)",   # ...PropertiesNV (queried before the device exists;
                                                  # filtered once the layer named its blind spot)
        "unknown VkStructureType (1000593001)",   # VkCooperativeMatrixFlexibleDimensionsPropertiesNV
        "SPV_NV_cooperative_matrix2", "SPV_NV_tensor_addressing",  # OpExtension
        "SPV_KHR_cooperative_matrix",             # which it requires
        "Invalid capability operand: 543",        # CooperativeMatrix{Reductions..BlockLoads}NV 5430-5434, TensorAddressingNV 5439
        "A SPIR-V Capability (Unhandled OpCapability) was declared",
        _SPEC_OPT_FAILED,
    ),
}

_UNKNOWN_STRUCT_MARKERS = [mk for mks in _BLIND_SPOT_MARKERS.values() for mk in mks
                           if mk.startswith("unknown VkStructureType")]


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.lower() not in ("0", "false", "no", "off")


@dataclass
class QueueFamily:
    index: int
    flags: int
    count: int
    timestamp_bits: int

    @property
    def compute(self) -> bool:
        return bool(self.flags & vk.VK_QUEUE_COMPUTE_BIT)

    @property
    def graphics(self) -> bool:
        return bool(self.flags & vk.VK_QUEUE_GRAPHICS_BIT)

    @property
    def transfer(self) -> bool:
        return bool(self.flags & vk.VK_QUEUE_TRANSFER_BIT)


@dataclass
class MemoryType:
    index: int
    flags: int
    heap: int


@dataclass
class MemoryHeap:
    index: int
    size: int
    flags: int


@dataclass
class CoopMatShape:
    m: int
    n: int
    k: int
    a_type: int
    b_type: int
    c_type: int
    result_type: int
    saturating: bool
    scope: int


@dataclass
class CoopMatFlex:
    """One VkCooperativeMatrixFlexibleDimensionsPropertiesNV: matrices of any size that is a
    multiple of the granularities, for these types, at this scope and workgroup size."""

    m_granularity: int
    n_granularity: int
    k_granularity: int
    a_type: int
    b_type: int
    c_type: int
    result_type: int
    saturating: bool
    scope: int
    workgroup_invocations: int


@dataclass
class PhysicalDeviceInfo:
    """Everything vkxsplit needs to know about one physical device, queried once."""

    index: int
    handle: Any
    name: str
    device_type: int
    vendor_id: int
    device_id: int
    api_version: int
    driver_version: int
    driver_name: str = ""
    driver_info: str = ""
    driver_id: int = 0
    device_uuid: bytes = b""
    driver_uuid: bytes = b""
    extensions: dict[str, int] = field(default_factory=dict)
    features: dict[str, bool] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    subgroup_size: int = 0
    min_subgroup_size: int = 0
    max_workgroup_subgroups: int = 0  # maxComputeWorkgroupSubgroups (0: not reported)
    max_subgroup_size: int = 0
    subgroup_stages: int = 0
    subgroup_ops: int = 0
    memory_types: list[MemoryType] = field(default_factory=list)
    memory_heaps: list[MemoryHeap] = field(default_factory=list)
    queue_families: list[QueueFamily] = field(default_factory=list)
    coopmat_shapes: list[CoopMatShape] = field(default_factory=list)
    #: VK_NV_cooperative_matrix2: its properties, and the workgroup-scope shapes of
    #: vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV
    coopmat2: dict[str, int] = field(default_factory=dict)
    coopmat2_flex: list[CoopMatFlex] = field(default_factory=list)
    min_imported_host_pointer_alignment: int = 0
    #: streaming multiprocessors (VK_NV_shader_sm_builtins) or compute units
    #: (VK_AMD_shader_core_properties); 0 where the driver does not say
    compute_units: int = 0

    @property
    def is_cpu(self) -> bool:
        """A Vulkan device that runs on the host's cores (lavapipe, SwiftShader)."""
        return self.device_type == vk.VK_PHYSICAL_DEVICE_TYPE_CPU

    @property
    def api_version_str(self) -> str:
        return version_str(self.api_version)

    @property
    def type_name(self) -> str:
        return {
            0: "other", 1: "integrated-gpu", 2: "discrete-gpu", 3: "virtual-gpu", 4: "cpu",
        }.get(self.device_type, "unknown")

    def has(self, ext: str) -> bool:
        return ext in self.extensions

    @property
    def is_lavapipe(self) -> bool:
        return self.driver_id == vk.VK_DRIVER_ID_MESA_LLVMPIPE or "llvmpipe" in self.name


_LIMIT_NAMES = (
    "maxComputeSharedMemorySize", "maxPushConstantsSize", "maxStorageBufferRange",
    "minStorageBufferOffsetAlignment", "maxMemoryAllocationCount", "timestampPeriod",
    "maxComputeWorkGroupInvocations", "maxBoundDescriptorSets", "nonCoherentAtomSize",
    "timestampComputeAndGraphics", "maxPerStageDescriptorStorageBuffers",
)

#: Validation messages that are the layer's own bugs, by exact message id, with why: they are
#: logged, not counted as findings.
KNOWN_LAYER_FALSE_POSITIVES = {
    # Synchronization validation of the 1.3.239 layer (Debian 12) waits a fixed time for a
    # timeline semaphore's state when a submission waits on a value that another thread (a
    # backend's host bridge) signals later; it then reports this, and its own text says
    # "This is most likely a validation bug". The semaphore waits themselves are checked by
    # the tests (every wait has a timeout and a result).
    "UNASSIGNED-VkSemaphore-state-timeout": "layer bug: timeline state timeout with host-signalled values",
}

_FEATURE_STRUCTS = {
    # name prefix -> (ctype, fields)
    "vk11": ("VkPhysicalDeviceVulkan11Features",
             ("storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess")),
    "vk12": ("VkPhysicalDeviceVulkan12Features",
             ("storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess", "shaderFloat16",
              "shaderInt8", "timelineSemaphore", "bufferDeviceAddress", "vulkanMemoryModel",
              "vulkanMemoryModelDeviceScope", "shaderBufferInt64Atomics",
              "scalarBlockLayout", "storagePushConstant8")),
    "vk13": ("VkPhysicalDeviceVulkan13Features",
             ("subgroupSizeControl", "computeFullSubgroups", "shaderIntegerDotProduct",
              "maintenance4", "synchronization2")),
}


def _query_coopmat_shapes(instance_handle: Any, handle: Any) -> list[CoopMatShape]:
    """vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR (an instance-level extension function)."""
    p = lib.vkGetInstanceProcAddr(instance_handle, b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    if p == NULL:
        return []
    fn = ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", p)
    n = ffi.new("uint32_t*")
    if fn(handle, n, NULL) < 0 or n[0] == 0:
        return []
    arr = ffi.new(f"VkCooperativeMatrixPropertiesKHR[{n[0]}]")
    for i in range(n[0]):
        arr[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    if fn(handle, n, arr) < 0:
        return []
    return [CoopMatShape(m=c.MSize, n=c.NSize, k=c.KSize, a_type=c.AType, b_type=c.BType, c_type=c.CType,
                         result_type=c.ResultType, saturating=bool(c.saturatingAccumulation), scope=c.scope)
            for c in arr[0:n[0]]]


def _query_coopmat_flex(instance_handle: Any, handle: Any) -> list[CoopMatFlex]:
    """vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV (VK_NV_cooperative_matrix2)."""
    p = lib.vkGetInstanceProcAddr(instance_handle, b"vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV")
    if p == NULL:
        return []
    fn = _bf16_ffi.cast("VkxPfnCoopFlex", int(ffi.cast("uintptr_t", p)))
    dev = _bf16_ffi.cast("void*", int(ffi.cast("uintptr_t", handle)))
    n = _bf16_ffi.new("uint32_t*")
    if fn(dev, n, _bf16_ffi.NULL) < 0 or n[0] == 0:
        return []
    arr = _bf16_ffi.new(f"VkxCoopFlexProperties[{n[0]}]")
    for i in range(n[0]):
        arr[i].sType = STYPE_COOPMAT_FLEX_PROPERTIES
    if fn(dev, n, arr) < 0:
        return []
    return [CoopMatFlex(c.MGranularity, c.NGranularity, c.KGranularity, c.AType, c.BType, c.CType,
                        c.ResultType, bool(c.saturatingAccumulation), c.scope, c.workgroupInvocations)
            for c in arr[0:n[0]]]


def _query_device(index: int, handle: Any, instance_handle: Any = None) -> PhysicalDeviceInfo:
    props = new("VkPhysicalDeviceProperties")
    lib.vkGetPhysicalDeviceProperties(handle, props)
    api = props.apiVersion
    info = PhysicalDeviceInfo(
        index=index, handle=handle, name=string(props.deviceName), device_type=props.deviceType,
        vendor_id=props.vendorID, device_id=props.deviceID, api_version=api,
        driver_version=props.driverVersion,
    )
    lim = props.limits
    info.limits = {n: getattr(lim, n) for n in _LIMIT_NAMES}
    info.limits["maxComputeWorkGroupCount"] = tuple(lim.maxComputeWorkGroupCount[i] for i in range(3))
    info.limits["maxComputeWorkGroupSize"] = tuple(lim.maxComputeWorkGroupSize[i] for i in range(3))

    for e in enumerate_(lib.vkEnumerateDeviceExtensionProperties, "VkExtensionProperties", handle, NULL):
        info.extensions[string(e.extensionName)] = e.specVersion

    # properties2 chain: subgroup (1.1), driver (1.2), then each extension's struct where the
    # device has the extension (None where it does not)
    p11 = new("VkPhysicalDeviceVulkan11Properties")
    p12 = new("VkPhysicalDeviceVulkan12Properties")
    p11.pNext = p12
    chain = [p12]

    def link(present: bool, ctype: str) -> Any:
        if not present:
            return None
        s = new(ctype)
        chain[-1].pNext = s
        chain.append(s)
        return s

    ssc = link(api >= API_1_3 or info.has("VK_EXT_subgroup_size_control"),
               "VkPhysicalDeviceSubgroupSizeControlProperties")
    hostp = link(info.has("VK_EXT_external_memory_host"), "VkPhysicalDeviceExternalMemoryHostPropertiesEXT")
    smp = link(info.has("VK_NV_shader_sm_builtins"), "VkPhysicalDeviceShaderSMBuiltinsPropertiesNV")
    amdp = link(info.has("VK_AMD_shader_core_properties"), "VkPhysicalDeviceShaderCorePropertiesAMD")
    tail = chain[-1]
    cm2p = None
    if info.has("VK_NV_cooperative_matrix2"):
        cm2p, cm2p_ptr = raw_struct("VkxCoopmat2Properties", STYPE_COOPMAT2_PROPERTIES)
        tail.pNext = cm2p_ptr  # last in the chain
    props2 = new("VkPhysicalDeviceProperties2", pNext=p11)
    lib.vkGetPhysicalDeviceProperties2(handle, props2)
    if cm2p is not None:
        info.coopmat2 = {f: int(getattr(cm2p, f)) for f in COOPMAT2_PROPERTIES}
    info.subgroup_size = p11.subgroupSize
    info.subgroup_stages = p11.subgroupSupportedStages
    info.subgroup_ops = p11.subgroupSupportedOperations
    info.device_uuid = bytes(ffi.buffer(p11.deviceUUID, 16))
    info.driver_uuid = bytes(ffi.buffer(p11.driverUUID, 16))
    info.driver_name = string(p12.driverName)
    info.driver_info = string(p12.driverInfo)
    info.driver_id = p12.driverID
    if ssc is not None:
        info.min_subgroup_size = ssc.minSubgroupSize
        info.max_subgroup_size = ssc.maxSubgroupSize
        info.max_workgroup_subgroups = ssc.maxComputeWorkgroupSubgroups
    else:
        info.min_subgroup_size = info.max_subgroup_size = info.subgroup_size
    if hostp is not None:
        info.min_imported_host_pointer_alignment = hostp.minImportedHostPointerAlignment
    if smp is not None:
        info.compute_units = int(smp.shaderSMCount)
    elif amdp is not None:
        info.compute_units = int(amdp.shaderEngineCount * amdp.shaderArraysPerEngineCount
                                 * amdp.computeUnitsPerShaderArray)

    # features2 chain
    structs: dict[str, Any] = {}
    head = new("VkPhysicalDeviceFeatures2")
    tail = head
    for key, (ctype, _fields) in _FEATURE_STRUCTS.items():
        if key == "vk13" and api < API_1_3:
            continue
        s = new(ctype)
        tail.pNext = s
        tail = s
        structs[key] = s
    coop = None
    if info.has("VK_KHR_cooperative_matrix"):
        coop = new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR")
        tail.pNext = coop
        tail = coop
    pexe = None
    if info.has("VK_KHR_pipeline_executable_properties"):
        pexe = new("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR")
        tail.pNext = pexe
        tail = pexe
    raw: list[Any] = []  # structs of this module's ffi, chained last
    bf16 = None
    if info.has("VK_KHR_shader_bfloat16"):
        bf16, bf16_ptr = new_bf16_features()
        raw.append((bf16, bf16_ptr))
    cm2 = None
    if info.has("VK_NV_cooperative_matrix2"):
        cm2, cm2_ptr = raw_struct("VkxCoopmat2Features", STYPE_COOPMAT2_FEATURES)
        raw.append((cm2, cm2_ptr))
    chain_raw(tail, raw)
    lib.vkGetPhysicalDeviceFeatures2(handle, head)
    for f in COOPMAT2_FEATURES:
        info.features[f] = bool(cm2 is not None and getattr(cm2, f))
    info.features["shaderInt64"] = bool(head.features.shaderInt64)
    info.features["shaderInt16"] = bool(head.features.shaderInt16)
    info.features["shaderFloat64"] = bool(head.features.shaderFloat64)
    for key, (_ctype, fields) in _FEATURE_STRUCTS.items():
        s = structs.get(key)
        for f in fields:
            info.features[f] = bool(s is not None and getattr(s, f))
    info.features["cooperativeMatrix"] = bool(coop is not None and coop.cooperativeMatrix)
    info.features["pipelineExecutableInfo"] = bool(pexe is not None and pexe.pipelineExecutableInfo)
    info.features["shaderBFloat16Type"] = bool(bf16 is not None and bf16.shaderBFloat16Type)
    info.features["shaderBFloat16CooperativeMatrix"] = bool(
        bf16 is not None and bf16.shaderBFloat16CooperativeMatrix)
    if instance_handle is not None and info.has("VK_KHR_cooperative_matrix"):
        info.coopmat_shapes = _query_coopmat_shapes(instance_handle, handle)
    if instance_handle is not None and info.has("VK_NV_cooperative_matrix2"):
        info.coopmat2_flex = _query_coopmat_flex(instance_handle, handle)

    mem = new("VkPhysicalDeviceMemoryProperties")
    lib.vkGetPhysicalDeviceMemoryProperties(handle, mem)
    info.memory_heaps = [MemoryHeap(i, mem.memoryHeaps[i].size, mem.memoryHeaps[i].flags)
                         for i in range(mem.memoryHeapCount)]
    info.memory_types = [MemoryType(i, mem.memoryTypes[i].propertyFlags, mem.memoryTypes[i].heapIndex)
                         for i in range(mem.memoryTypeCount)]

    n = ffi.new("uint32_t*")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(handle, n, NULL)
    qf = ffi.new(f"VkQueueFamilyProperties[{n[0]}]")
    lib.vkGetPhysicalDeviceQueueFamilyProperties(handle, n, qf)
    info.queue_families = [QueueFamily(i, qf[i].queueFlags, qf[i].queueCount, qf[i].timestampValidBits)
                           for i in range(n[0])]
    return info


class Instance:
    """Owns the VkInstance (and the validation messenger). One per process is plenty.

    ``validation`` defaults to ``VKXSPLIT_VALIDATION``. Messages of warning or error severity
    from the validation layer are appended to ``self.messages`` (and logged).
    """

    def __init__(self, validation: bool | None = None, app_name: str = "vkxsplit",
                 extra_extensions: Sequence[str] = ()) -> None:
        if validation is None:
            validation = env_flag("VKXSPLIT_VALIDATION")
        self.validation = validation
        self._messages: list[str] = []
        # extensions the validation layer said it does not know (see _BLIND_SPOT_MARKERS)
        self.layer_blind_spots: set[str] = set()
        self._lock = threading.Lock()
        self.handle: Any = None
        self._messenger: Any = None
        self._callback: Any = None

        layers_avail = {string(p.layerName): p for p in
                        enumerate_(lib.vkEnumerateInstanceLayerProperties, "VkLayerProperties")}
        exts_avail = {string(e.extensionName) for e in
                      enumerate_(lib.vkEnumerateInstanceExtensionProperties, "VkExtensionProperties", NULL)}
        self.available_layers = sorted(layers_avail)
        self.available_extensions = sorted(exts_avail)
        ver = ffi.new("uint32_t*")
        check(lib.vkEnumerateInstanceVersion(ver), "vkEnumerateInstanceVersion")
        self.api_version = ver[0]
        if self.api_version < API_1_2:
            raise EnvironmentProblem(
                f"the Vulkan loader is version {version_str(self.api_version)}; vkxsplit needs 1.2 or newer",
                "update libvulkan1 (apt-get install libvulkan1) or your driver")

        layers: list[str] = []
        exts: list[str] = []
        if validation:
            if VALIDATION_LAYER not in layers_avail:
                raise EnvironmentProblem(
                    f"validation was requested (VKXSPLIT_VALIDATION) but {VALIDATION_LAYER} is not installed",
                    "apt-get install vulkan-validationlayers, or unset VKXSPLIT_VALIDATION")
            layers.append(VALIDATION_LAYER)
            exts.append("VK_EXT_debug_utils")
        for e in ("VK_KHR_get_physical_device_properties2", "VK_KHR_external_memory_capabilities",
                  "VK_KHR_external_semaphore_capabilities", "VK_KHR_external_fence_capabilities"):
            if e in exts_avail:
                exts.append(e)
        if "VK_KHR_portability_enumeration" in exts_avail:
            exts.append("VK_KHR_portability_enumeration")
        # Extra instance extensions a caller needs (e.g. the surface extensions GLFW asks for).
        missing_extra = [e for e in extra_extensions if e not in exts_avail]
        if missing_extra:
            raise EnvironmentProblem(
                "the Vulkan loader lacks instance extension(s) " + ", ".join(missing_extra),
                "install a loader/driver that offers them (`vulkaninfo --summary` lists what is there)")
        exts += [e for e in extra_extensions if e not in exts]
        self.enabled_extensions = exts
        self.enabled_layers = layers

        c_layers = [cstr(x) for x in layers]
        c_exts = [cstr(x) for x in exts]
        p_layers = ffi.new("char*[]", c_layers) if c_layers else NULL
        p_exts = ffi.new("char*[]", c_exts) if c_exts else NULL
        app_cname = cstr(app_name)
        app = new("VkApplicationInfo", pApplicationName=app_cname, applicationVersion=1,
                  pEngineName=app_cname, engineVersion=1,
                  apiVersion=min(self.api_version, API_1_3))
        ci = new("VkInstanceCreateInfo", pApplicationInfo=app, enabledLayerCount=len(layers),
                 ppEnabledLayerNames=p_layers, enabledExtensionCount=len(exts), ppEnabledExtensionNames=p_exts)
        if "VK_KHR_portability_enumeration" in exts:
            ci.flags = vk.VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
        mci = None
        if validation:
            self._callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self._on_message)
            mci = new("VkDebugUtilsMessengerCreateInfoEXT",
                      messageSeverity=vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
                      | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
                      messageType=vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
                      | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT
                      | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT,
                      pfnUserCallback=self._callback)
            ci.pNext = mci
        out = ffi.new("VkInstance*")
        res = lib.vkCreateInstance(ci, NULL, out)
        if res == vk.VK_ERROR_INCOMPATIBLE_DRIVER:
            raise EnvironmentProblem("no Vulkan driver (ICD) could be loaded: vkCreateInstance returned "
                                     "VK_ERROR_INCOMPATIBLE_DRIVER",
                                     "install a driver: apt-get install mesa-vulkan-drivers (lavapipe, CPU) "
                                     "or your GPU vendor's Vulkan driver; check VK_DRIVER_FILES/VK_ICD_FILENAMES")
        check(res, "vkCreateInstance")
        self.handle = out[0]
        if validation and mci is not None:
            fn = self.proc("vkCreateDebugUtilsMessengerEXT")
            m = ffi.new("VkDebugUtilsMessengerEXT*")
            check(fn(self.handle, mci, NULL, m), "vkCreateDebugUtilsMessengerEXT")
            self._messenger = m[0]
        self._devices: list[PhysicalDeviceInfo] | None = None

    def _on_message(self, severity: int, types: int, data: Any, user: Any) -> int:
        try:
            msg = string(data.pMessage) if data.pMessage != NULL else "(no message)"
            ident = string(data.pMessageIdName) if data.pMessageIdName != NULL else ""
            # The loader's own notes about layers/ICDs (general, warning) are not validation
            # findings; everything from the validation layer counts.
            if types == vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT and \
                    severity < vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT:
                log.info("vulkan: %s %s", ident, msg)
                return 0
            if ident in KNOWN_LAYER_FALSE_POSITIVES:
                log.info("vulkan validation (a known layer false positive, not counted): %s %s", ident, msg)
                return 0
            m = _LAYER_DOES_NOT_KNOW.search(msg)
            if m:  # the layer is older than an extension we enabled: a note, not a finding
                with self._lock:
                    self.layer_blind_spots.add(m.group(1))
                log.info("vulkan validation layer: %s", msg)
                return 0
            with self._lock:
                self._messages.append(f"{ident}: {msg}")
            log.warning("vulkan validation: %s %s", ident, msg)
        except Exception:  # never raise through a C callback
            pass
        return 0

    @property
    def messages(self) -> list[str]:
        """The validation findings so far (a copy), without those that only show the layer is
        older than an extension it said it does not know."""
        with self._lock:
            msgs, blind = list(self._messages), set(self.layer_blind_spots)
        markers = [mk for ext in blind for mk in _BLIND_SPOT_MARKERS.get(ext, ())]
        # An "unknown VkStructureType" message for one of the listed extensions' structures is
        # the layer saying it does not know that structure, even before any device made it
        # name the extension (vkxsplit info queries properties without creating a device).
        markers += _UNKNOWN_STRUCT_MARKERS
        return [x for x in msgs if not any(mk in x for mk in markers)]

    def clear_messages(self) -> None:
        with self._lock:
            self._messages.clear()

    def proc(self, name: str) -> Any:
        """An instance-level extension function, cast to its PFN type."""
        p = lib.vkGetInstanceProcAddr(self.handle, name.encode())
        if p == NULL:
            raise VkxError(f"instance function {name} is not available")
        return ffi.cast(f"PFN_{name}", p)

    def physical_devices(self) -> list[PhysicalDeviceInfo]:
        if self._devices is None:
            handles = enumerate_(lib.vkEnumeratePhysicalDevices, "VkPhysicalDevice", self.handle)
            self._devices = [_query_device(i, h, self.handle) for i, h in enumerate(handles)]
        return self._devices

    def select(self, selector: str | int | None = None) -> PhysicalDeviceInfo:
        """Pick a device by index or name substring (default: ``VKXSPLIT_DEVICE``, else the
        first discrete GPU, else the first device)."""
        devs = self.physical_devices()
        if not devs:
            raise EnvironmentProblem(
                "Vulkan found no physical device",
                "install a driver: apt-get install mesa-vulkan-drivers (lavapipe) or your GPU's driver; "
                "`vulkaninfo --summary` shows what the loader sees")
        if selector is None:
            selector = os.environ.get("VKXSPLIT_DEVICE") or None
        if selector is None:
            for d in devs:
                if d.device_type == vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU:
                    return d
            return devs[0]
        if isinstance(selector, int) or str(selector).isdigit():
            i = int(selector)
            if not 0 <= i < len(devs):
                raise EnvironmentProblem(
                    f"device index {i} does not exist (found {len(devs)}: "
                    + ", ".join(f"{d.index}={d.name}" for d in devs) + ")",
                    "set VKXSPLIT_DEVICE to one of those indices or a part of a name")
            return devs[i]
        for d in devs:
            if str(selector).lower() in d.name.lower():
                return d
        raise EnvironmentProblem(
            f"no device name contains {selector!r} (found: " + ", ".join(d.name for d in devs) + ")",
            "set VKXSPLIT_DEVICE to an index or a part of one of those names")

    def close(self) -> None:
        if self.handle is None:
            return
        if self._messenger is not None:
            self.proc("vkDestroyDebugUtilsMessengerEXT")(self.handle, self._messenger, NULL)
            self._messenger = None
        lib.vkDestroyInstance(self.handle, NULL)
        self.handle = None

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
