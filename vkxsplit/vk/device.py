"""The logical device: the hub.

``Device`` enables what the physical device offers (driven by :class:`PhysicalDeviceInfo`),
owns the compute queue, the command pool, the memory allocator, the pipeline cache and the
descriptor pools, and destroys them in reverse order on :meth:`Device.close`. Everything
else made on a device is owned by an object that the device tracks and closes first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..cachefile import atomic_write
from ..errors import Closable, EnvironmentProblem, VkxError
from ..features import disabled_from_env
from .api import API_1_3, NULL, check, cstr, ffi, lib, new, next_serial, vk
from .instance import (
    COOPMAT2_FEATURES,
    STYPE_COOPMAT2_FEATURES,
    Instance,
    PhysicalDeviceInfo,
    chain_raw,
    env_flag,
    new_bf16_features,
    raw_struct,
)

log = logging.getLogger("vkxsplit.vk")

# VkDevices not destroyed yet, per instance (id(instance) -> [count, close requested]). A device
# whose destruction waits for a live numpy view (vk.memory._Pin) must not be destroyed after its
# instance: the device owning the instance (Device.open) asks for the instance's close, which
# happens once the last device made on it (e.g. a vulkan peer's) is gone.
_LIVE_LOCK = threading.Lock()
_LIVE_DEVICES: dict[int, list[Any]] = {}


def _device_made(instance: Any) -> None:
    with _LIVE_LOCK:
        _LIVE_DEVICES.setdefault(id(instance), [0, False])[0] += 1


def _device_destroyed(instance: Any, close_instance: bool) -> None:
    with _LIVE_LOCK:
        entry = _LIVE_DEVICES.setdefault(id(instance), [1, False])
        entry[0] -= 1
        entry[1] = entry[1] or close_instance
        last = entry[0] <= 0
        if last:
            del _LIVE_DEVICES[id(instance)]
    if last and entry[1]:
        instance.close()

# Extensions enabled whenever the device offers them (core-promoted ones only matter on 1.2).
OPTIONAL_EXTENSIONS = (
    "VK_KHR_external_memory", "VK_KHR_external_memory_fd", "VK_EXT_external_memory_dma_buf",
    "VK_EXT_external_memory_host", "VK_KHR_external_semaphore", "VK_KHR_external_semaphore_fd",
    "VK_KHR_external_fence", "VK_KHR_external_fence_fd", "VK_EXT_queue_family_foreign",
    "VK_KHR_cooperative_matrix", "VK_KHR_shader_bfloat16", "VK_EXT_subgroup_size_control",
    "VK_KHR_shader_integer_dot_product", "VK_KHR_8bit_storage", "VK_KHR_16bit_storage",
    "VK_KHR_shader_float16_int8", "VK_KHR_timeline_semaphore", "VK_EXT_image_drm_format_modifier",
    "VK_NV_cooperative_matrix2",
)
#: what the workgroup-scope kernels (mul_mat_cm2) need of VK_NV_cooperative_matrix2; the
#: extension is enabled only with all of them (and bufferDeviceAddress: their decode functions
#: take a physical-storage-buffer pointer to the weight block)
COOPMAT2_NEEDS = ("cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                  "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads", "bufferDeviceAddress")

#: pipeline compiler statistics (VKXSPLIT_PIPELINE_STATS=1): enabled only when asked for
PIPELINE_STATS_EXT = "VK_KHR_pipeline_executable_properties"

# (feature name, why it is needed); a device lacking one of these cannot be a hub.
REQUIRED_FEATURES = (
    ("timelineSemaphore", "every backend stream synchronises on timeline semaphores"),
    ("storageBuffer16BitAccess", "f16/bf16 tensors and quantized block scales are 16-bit"),
    ("storageBuffer8BitAccess", "quantized weights are read as bytes"),
)

# Features switched on when present (feature struct key in PhysicalDeviceInfo.features).
_V11 = ("storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess")
_V12 = ("storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess", "shaderFloat16", "shaderInt8",
        "timelineSemaphore", "vulkanMemoryModel", "vulkanMemoryModelDeviceScope", "scalarBlockLayout",
        "storagePushConstant8")
_V13 = ("subgroupSizeControl", "computeFullSubgroups", "shaderIntegerDotProduct", "maintenance4",
        "synchronization2")


def cache_dir() -> Path:
    d = os.environ.get("VKXSPLIT_CACHE_DIR")
    if d:
        return Path(d)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vkxsplit"



def coopmat2_enablable(physical: Any) -> bool:
    """Whether a Device on ``physical`` enables VK_NV_cooperative_matrix2: the extension, the
    cooperativeMatrix feature and every feature of COOPMAT2_NEEDS."""
    feats = physical.features
    return (physical.has("VK_NV_cooperative_matrix2") and bool(feats.get("cooperativeMatrix"))
            and all(feats.get(f) for f in COOPMAT2_NEEDS))

class Device(Closable):
    """The hub's logical device. Use :meth:`open` or ``Device(instance, physical)``.

    After :meth:`close` every method raises :class:`~vkxsplit.errors.ClosedError`; a numpy
    view of one of its buffers still alive then defers the VkDevice's destruction (and the
    instance's, when the device owns it) until the last such view is gone (``vk.memory._Pin``)."""

    # (children that close after the device call disown(); error messages and reports read these)
    _closed_exempt = ("name", "disown", "is_cpu")

    def __init__(self, instance: Instance, physical: PhysicalDeviceInfo) -> None:
        self.instance = instance
        self.physical = physical
        self.handle: Any = None
        # Objects made on this device that have not been closed yet (strong references: the
        # device is the owner of last resort and destroys them, newest first, on close()).
        self._children: dict[int, Any] = {}
        self._queue_lock = threading.Lock()
        self._fns: dict[str, Any] = {}
        self._owns_instance = False
        # the kernel features switched off (VKXSPLIT_DISABLE, read once here; every kernel
        # choice on this device reads this set: vkxsplit.features)
        self.disabled: frozenset[str] = disabled_from_env()
        # synchronization validation on (VK_LAYER_ENABLES, read by the layer when the instance
        # was made, just before): host semaphore calls are serialized (vk.event._HOST_SYNC_LOCK)
        self.serialize_semaphores = bool(getattr(instance, "validation", False)) and \
            "SYNCHRONIZATION_VALIDATION" in os.environ.get("VK_LAYER_ENABLES", "")

        missing = [(f, why) for f, why in REQUIRED_FEATURES if not physical.features.get(f)]
        if missing:
            f, why = missing[0]
            raise EnvironmentProblem(
                f"device '{physical.name}' lacks the Vulkan feature {f} ({why})",
                "use another device (VKXSPLIT_DEVICE) or update the driver (Mesa >= 22 for lavapipe)")

        qf = self._pick_queue_family()
        self.queue_family = qf.index
        self.timestamp_bits = qf.timestamp_bits

        feats = physical.features
        exts = [e for e in OPTIONAL_EXTENSIONS if physical.has(e)]
        if "VK_NV_cooperative_matrix2" in exts and not coopmat2_enablable(physical):
            exts.remove("VK_NV_cooperative_matrix2")
        if physical.api_version >= API_1_3:
            exts = [e for e in exts if e not in ("VK_EXT_subgroup_size_control",
                                                 "VK_KHR_shader_integer_dot_product")]
        self.extensions = set(exts)
        cm2_on = "VK_NV_cooperative_matrix2" in self.extensions
        f11 = new("VkPhysicalDeviceVulkan11Features")
        for f in _V11:
            setattr(f11, f, 1 if feats.get(f) else 0)
        f12 = new("VkPhysicalDeviceVulkan12Features")
        for f in _V12:
            setattr(f12, f, 1 if feats.get(f) else 0)
        f12.bufferDeviceAddress = 1 if cm2_on else 0
        f11.pNext = f12
        tail = f12
        f13 = None
        if physical.api_version >= API_1_3:
            f13 = new("VkPhysicalDeviceVulkan13Features")
            for f in _V13:
                setattr(f13, f, 1 if feats.get(f) else 0)
            tail.pNext = f13
            tail = f13
        coop = None
        if "VK_KHR_cooperative_matrix" in self.extensions and feats.get("cooperativeMatrix"):
            coop = new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR", cooperativeMatrix=1)
            tail.pNext = coop
            tail = coop
        # compiler statistics of every pipeline (registers, spills: Kernel.statistics), asked for
        # with VKXSPLIT_PIPELINE_STATS=1 (benchmarks); drivers may compile differently when
        # capturing, so never by default
        self.pipeline_stats = (env_flag("VKXSPLIT_PIPELINE_STATS") and physical.has(PIPELINE_STATS_EXT)
                               and bool(feats.get("pipelineExecutableInfo")))
        pstats = None
        if self.pipeline_stats:
            exts.append(PIPELINE_STATS_EXT)
            self.extensions.add(PIPELINE_STATS_EXT)
            pstats = new("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR", pipelineExecutableInfo=1)
            tail.pNext = pstats
            tail = pstats
        # structs declared in instance.py's own ffi (newer than the vulkan package): last in the chain
        raw: list[Any] = []
        bf16 = None
        if "VK_KHR_shader_bfloat16" in self.extensions and feats.get("shaderBFloat16Type"):
            bf16, bf16_ptr = new_bf16_features()
            bf16.shaderBFloat16Type = 1
            bf16.shaderBFloat16CooperativeMatrix = 1 if feats.get("shaderBFloat16CooperativeMatrix") else 0
            raw.append((bf16, bf16_ptr))
        cm2 = None
        if cm2_on:
            cm2, cm2_ptr = raw_struct("VkxCoopmat2Features", STYPE_COOPMAT2_FEATURES)
            for f in COOPMAT2_FEATURES:
                setattr(cm2, f, 1 if feats.get(f) else 0)
            raw.append((cm2, cm2_ptr))
        chain_raw(tail, raw)
        core = new("VkPhysicalDeviceFeatures")
        core.shaderInt64 = 1 if feats.get("shaderInt64") else 0
        core.shaderInt16 = 1 if feats.get("shaderInt16") else 0
        self.features = {k: v for k, v in feats.items() if v}
        if not cm2_on:
            for f in (*COOPMAT2_FEATURES, "bufferDeviceAddress"):
                self.features.pop(f, None)
        self.coopmat2 = cm2_on
        self.coopmat = coop is not None
        self.bf16 = bf16 is not None

        prio = ffi.new("float[1]", [1.0])
        qci = new("VkDeviceQueueCreateInfo", queueFamilyIndex=qf.index, queueCount=1, pQueuePriorities=prio)
        c_exts = [cstr(e) for e in exts]
        p_exts = ffi.new("char*[]", c_exts) if c_exts else NULL
        dci = new("VkDeviceCreateInfo", pNext=f11, queueCreateInfoCount=1, pQueueCreateInfos=qci,
                  enabledExtensionCount=len(exts), ppEnabledExtensionNames=p_exts, pEnabledFeatures=core)
        out = ffi.new("VkDevice*")
        check(lib.vkCreateDevice(physical.handle, dci, NULL, out), "vkCreateDevice",
              f"device '{physical.name}' refused the features/extensions vkxsplit asked for")
        self.handle = out[0]
        q = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.handle, qf.index, 0, q)
        self.queue = q[0]

        cpci = new("VkCommandPoolCreateInfo", queueFamilyIndex=qf.index,
                   flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT)
        pool = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(self.handle, cpci, NULL, pool), "vkCreateCommandPool")
        self.command_pool = pool[0]
        self._pool_lock = threading.Lock()

        self.pipeline_cache = self._create_pipeline_cache()

        from .memory import Allocator  # local import: memory needs Device's type only at runtime

        self.memory = Allocator(self)
        _device_made(instance)
        log.info("hub device: %s (%s, Vulkan %s), queue family %d, extensions: %s", physical.name,
                 physical.driver_name, physical.api_version_str, qf.index, ", ".join(sorted(exts)))

    # -- construction helpers -----------------------------------------------------------

    @classmethod
    def open(cls, selector: str | int | None = None, validation: bool | None = None) -> Device:
        """Create an instance and a device on the selected physical device (owns both)."""
        inst = Instance(validation=validation)
        try:
            dev = cls(inst, inst.select(selector))
        except BaseException:
            inst.close()
            raise
        dev._owns_instance = True
        return dev

    def _pick_queue_family(self) -> Any:
        fams = [q for q in self.physical.queue_families if q.compute and q.count > 0]
        if not fams:
            raise EnvironmentProblem(f"device '{self.physical.name}' has no compute queue",
                                     "use another device (VKXSPLIT_DEVICE)")
        # Prefer a compute family without graphics (async compute), when it has timestamps.
        dedicated = [q for q in fams if not q.graphics and q.timestamp_bits > 0]
        if dedicated and not env_flag("VKXSPLIT_GRAPHICS_QUEUE"):
            return dedicated[0]
        return fams[0]

    def _cache_path(self) -> Path:
        key = hashlib.sha256(self.physical.device_uuid + self.physical.driver_uuid +
                             self.physical.driver_version.to_bytes(4, "little")).hexdigest()[:16]
        return cache_dir() / f"pipelines-{key}.bin"

    def _create_pipeline_cache(self) -> Any:
        data = b""
        if not env_flag("VKXSPLIT_NO_PIPELINE_CACHE"):
            try:
                data = self._cache_path().read_bytes()
            except OSError:
                data = b""
        buf = ffi.from_buffer(data) if data else NULL
        ci = new("VkPipelineCacheCreateInfo", initialDataSize=len(data), pInitialData=buf)
        out = ffi.new("VkPipelineCache*")
        res = lib.vkCreatePipelineCache(self.handle, ci, NULL, out)
        if res < 0 and data:  # a stale or foreign cache: start empty
            ci.initialDataSize = 0
            ci.pInitialData = NULL
            res = lib.vkCreatePipelineCache(self.handle, ci, NULL, out)
        check(res, "vkCreatePipelineCache")
        return out[0]

    def _save_pipeline_cache(self) -> None:
        if env_flag("VKXSPLIT_NO_PIPELINE_CACHE"):
            return
        n = ffi.new("size_t*")
        if lib.vkGetPipelineCacheData(self.handle, self.pipeline_cache, n, NULL) < 0 or n[0] == 0:
            return
        buf = ffi.new(f"char[{n[0]}]")
        if lib.vkGetPipelineCacheData(self.handle, self.pipeline_cache, n, buf) < 0:
            return
        try:
            p = self._cache_path()
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(p, ffi.buffer(buf, n[0])[:])
        except OSError as exc:
            log.info("pipeline cache not saved: %s", exc)

    # -- services -----------------------------------------------------------------------

    def fn(self, name: str) -> Any:
        """A device-level extension function cast to its PFN type (cached)."""
        f = self._fns.get(name)
        if f is None:
            p = lib.vkGetDeviceProcAddr(self.handle, name.encode())
            if p == NULL:
                raise VkxError(f"device function {name} is not available on '{self.physical.name}'",
                               "its extension is missing; `vkxsplit info` lists what the device has")
            f = ffi.cast(f"PFN_{name}", p)
            self._fns[name] = f
        return f

    def adopt(self, child: Any) -> None:
        """Track an object (with ``close()``) so :meth:`close` destroys it before the device."""
        if getattr(child, "_serial", None) is None:
            child._serial = next_serial()
        self._children[id(child)] = child

    def disown(self, child: Any) -> None:
        """Forget a child that closed itself (called from the child's ``close()``)."""
        self._children.pop(id(child), None)

    def submit(self, submit_infos: Any, count: int = 1, fence: Any = NULL) -> None:
        """``vkQueueSubmit`` under the queue lock (queues need external synchronisation)."""
        with self._queue_lock:
            check(lib.vkQueueSubmit(self.queue, count, submit_infos, fence), "vkQueueSubmit")

    def wait_idle(self) -> None:
        with self._queue_lock:
            check(lib.vkQueueWaitIdle(self.queue), "vkQueueWaitIdle")

    @property
    def name(self) -> str:
        return self.physical.name

    @property
    def is_cpu(self) -> bool:
        """A Vulkan device that runs on the host's cores (lavapipe, SwiftShader)."""
        return self.physical.is_cpu

    def close(self) -> None:
        if self.handle is None:
            return
        lib.vkDeviceWaitIdle(self.handle)
        # Children first (kernels, sequences, semaphores, buffers), newest first.
        for child in sorted(self._children.values(), key=lambda c: -c._serial):
            try:
                child.close()
            except Exception as exc:  # keep tearing down
                log.warning("closing %r: %s", child, exc)
        self._save_pipeline_cache()
        lib.vkDestroyPipelineCache(self.handle, self.pipeline_cache, NULL)
        lib.vkDestroyCommandPool(self.handle, self.command_pool, NULL)
        handle, self.handle = self.handle, None
        instance, owns = self.instance, self._owns_instance

        def destroy() -> None:  # once no block is left (now, or after the last numpy view)
            lib.vkDestroyDevice(handle, NULL)
            _device_destroyed(instance, owns)  # (the instance closes after its last device)

        if not self.memory.close(on_drained=destroy):
            destroy()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
