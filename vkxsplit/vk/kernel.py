"""Kernels: compute pipelines made from the shipped SPIR-V.

A variant that shares its module with others (``vkxsplit.shaders``: specialization constants
for workgroup and tile sizes) gets its spec values through VkSpecializationInfo; each variant
name is its own pipeline, and the driver's pipeline cache keys on the values with the module.

``Kernel.get(device, "convert_f32_bf16")`` returns the device's one pipeline for a variant
(created on first use through the device's pipeline cache): a shipped one, or one of a
directory of experiment kernels made loadable with :func:`vkxsplit.shaders.add_kernel_dir`
(benchmarks and tests build those on demand: ``tools/kernels.py``). A kernel binds ``bindings``
storage buffers at set 0 and takes its push constants as a ``struct`` format from the
manifest. Descriptor sets are made per distinct set of bound ranges and kept, so a
sequence recorded once can be replayed without touching descriptors again.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Union

from .. import shaders
from ..errors import KernelError
from .api import NULL, check, ffi, lib, new, next_serial, vk
from .memory import Buffer

if TYPE_CHECKING:
    from .device import Device


class View:
    """A byte range of a buffer, for binding part of it (a KV-cache layer, a row slice)."""

    __slots__ = ("buffer", "offset", "size")

    def __init__(self, buffer: Buffer, offset: int = 0, size: int | None = None) -> None:
        self.buffer = buffer
        self.offset = offset
        self.size = buffer.size - offset if size is None else size

    @property
    def abs_offset(self) -> int:
        return self.buffer.offset + self.offset


Bindable = Union[Buffer, View]  # noqa: UP007 (a runtime alias: py3.10 needs Union here)


def as_range(b: Bindable) -> tuple[Any, int, int, int]:
    """(VkBuffer, absolute offset, size, block serial) of a binding."""
    if isinstance(b, View):
        return b.buffer.handle, b.abs_offset, b.size, b.buffer.block._serial
    return b.handle, b.offset, b.size, b.block._serial


def spans_overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """Whether two (block serial, first byte, end byte) spans share a byte: the one overlap rule,
    of the op checks and of the graph's dependencies (``vkxsplit.graph.overlap``)."""
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def bindings_overlap(a: Bindable, b: Bindable) -> bool:
    """Whether two bindings share a byte (the same block, intersecting byte ranges)."""
    _, oa, sa, ba = as_range(a)
    _, ob, sb, bb = as_range(b)
    return spans_overlap((ba, oa, oa + sa), (bb, ob, ob + sb))


def _specialization(name: str, spec: dict[str, int], ids: dict[str, int]) -> tuple[Any, list[Any]]:
    """VkSpecializationInfo for ``spec`` (name -> value; ``ids`` name -> constant_id): one
    VkSpecializationMapEntry of 4 bytes per constant; NULL for none. The second value holds
    the arrays the struct points to (keep it alive until the pipeline is made)."""
    if not spec:
        return NULL, []
    if set(spec) != set(ids):
        raise KernelError(f"kernel {name}: spec values {sorted(spec)} do not match its module's constants "
                          f"{sorted(ids)}", "rebuild the shaders: vkxsplit build-shaders")
    names = sorted(spec, key=lambda k: ids[k])
    entries = ffi.new(f"VkSpecializationMapEntry[{len(names)}]")
    data = bytearray()
    for i, k in enumerate(names):
        entries[i].constantID = int(ids[k])
        entries[i].offset = len(data)
        entries[i].size = 4
        v = int(spec[k])
        data += struct.pack("=i" if v < 0 else "=I", v)
    buf = ffi.new("char[]", bytes(data))
    info = new("VkSpecializationInfo", mapEntryCount=len(names), pMapEntries=entries, dataSize=len(data),
               pData=buf)
    return info, [entries, buf]


def workgroup_fits(device: Device, local_size: tuple[int, ...]) -> bool:
    """Whether ``device`` runs workgroups of ``local_size`` (x, y, z): each dimension within
    maxComputeWorkGroupSize and the product within maxComputeWorkGroupInvocations (a limit the
    device does not report counts as no limit)."""
    lim = device.physical.limits
    most = lim.get("maxComputeWorkGroupSize") or (2**31,) * 3
    inv = int(lim.get("maxComputeWorkGroupInvocations") or 2**31)
    ls = (tuple(local_size) + (1, 1, 1))[:3]
    return all(a <= b for a, b in zip(ls, most)) and ls[0] * ls[1] * ls[2] <= inv


class Kernel:
    def __init__(self, device: Device, name: str) -> None:
        meta = shaders.variant_meta(name)
        if meta is None:
            raise KernelError(f"no kernel named {name} ships with vkxsplit or is in a loaded kernel directory",
                              "check the variant name; experiment kernels: build them (python "
                              "tools/build_tool_shaders.py) and load them (tools/kernels.py ensure())")
        missing = [f for f in meta.get("requires", []) if not device.features.get(f)]
        if missing:
            raise KernelError(f"kernel {name} needs device feature(s) {', '.join(missing)}, "
                              f"which '{device.name}' lacks")
        self.device = device
        self.name = name
        self.meta = meta
        self.bindings = int(meta["bindings"])
        self.writes = tuple(meta["writes"])
        self.push_format = "=" + meta.get("push", "")
        self.push_size = struct.calcsize(self.push_format)
        self.local_size = tuple(meta["local_size"])
        ls = self.local_size
        if not workgroup_fits(device, ls):
            lim = device.physical.limits
            most = lim.get("maxComputeWorkGroupSize") or (2**31,) * 3
            inv = int(lim.get("maxComputeWorkGroupInvocations") or 2**31)
            raise KernelError(f"kernel {name}: workgroup {ls[0]}x{ls[1]}x{ls[2]} is over '{device.name}''s "
                              f"limits ({most[0]}x{most[1]}x{most[2]}, {inv} invocations)",
                              "choose a smaller workgroup size (spec value) for this device")
        self._serial = next_serial()
        self._sets: dict[tuple[Any, ...], Any] = {}
        self._pools: list[Any] = []
        self._pool_left = 0
        d = device.handle

        code = shaders.spirv(name)
        code_buf = ffi.from_buffer("uint32_t[]", code)
        smci = new("VkShaderModuleCreateInfo", codeSize=len(code), pCode=code_buf)
        sm = ffi.new("VkShaderModule*")
        check(lib.vkCreateShaderModule(d, smci, NULL, sm), f"vkCreateShaderModule({name})")
        self.module = sm[0]

        binds = ffi.new(f"VkDescriptorSetLayoutBinding[{self.bindings}]")
        for i in range(self.bindings):
            binds[i].binding = i
            binds[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            binds[i].descriptorCount = 1
            binds[i].stageFlags = vk.VK_SHADER_STAGE_COMPUTE_BIT
        dslci = new("VkDescriptorSetLayoutCreateInfo", bindingCount=self.bindings, pBindings=binds)
        dsl = ffi.new("VkDescriptorSetLayout*")
        check(lib.vkCreateDescriptorSetLayout(d, dslci, NULL, dsl), "vkCreateDescriptorSetLayout")
        self.set_layout = dsl[0]

        pcr = new("VkPushConstantRange", stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0,
                  size=self.push_size)
        self._set_layouts = ffi.new("VkDescriptorSetLayout[1]", [self.set_layout])
        plci = new("VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=self._set_layouts,
                   pushConstantRangeCount=1 if self.push_size else 0, pPushConstantRanges=pcr)
        pl = ffi.new("VkPipelineLayout*")
        check(lib.vkCreatePipelineLayout(d, plci, NULL, pl), "vkCreatePipelineLayout")
        self.layout = pl[0]

        entry = ffi.new("char[]", b"main")
        self.spec = {k: int(v) for k, v in (meta.get("spec") or {}).items()}
        spec_info, _keep = _specialization(name, self.spec, meta.get("spec_ids") or {})
        stage = new("VkPipelineShaderStageCreateInfo", stage=vk.VK_SHADER_STAGE_COMPUTE_BIT,
                    module=self.module, pName=entry, pSpecializationInfo=spec_info)
        sg = int(meta.get("subgroup_size", 0))
        rss = None
        if sg:
            p = device.physical
            if not (device.features.get("subgroupSizeControl") and p.min_subgroup_size <= sg <= p.max_subgroup_size):
                raise KernelError(f"kernel {name} needs subgroup size {sg}; '{device.name}' offers "
                                  f"{p.min_subgroup_size}..{p.max_subgroup_size}")
            rss = new("VkPipelineShaderStageRequiredSubgroupSizeCreateInfo", requiredSubgroupSize=sg)
            stage.pNext = rss
        cpci = new("VkComputePipelineCreateInfo", stage=stage[0], layout=self.layout, basePipelineIndex=-1,
                   flags=vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR if device.pipeline_stats else 0)
        pipe = ffi.new("VkPipeline*")
        check(lib.vkCreateComputePipelines(d, device.pipeline_cache, 1, cpci, NULL, pipe),
              f"vkCreateComputePipelines({name})")
        self.pipeline = pipe[0]
        device.adopt(self)

    def statistics(self) -> dict[str, float]:
        """The driver's compiler statistics of this pipeline (VK_KHR_pipeline_executable_properties:
        on NVIDIA e.g. "Register Count", on Mesa "SGPRs"/"Spill count"...), name -> value; needs
        the device opened with VKXSPLIT_PIPELINE_STATS=1 on a driver with the extension
        (``{}`` otherwise)."""
        dev = self.device
        if not getattr(dev, "pipeline_stats", False) or self.pipeline is None:
            return {}
        exe = new("VkPipelineExecutableInfoKHR", pipeline=self.pipeline, executableIndex=0)
        get = dev.fn("vkGetPipelineExecutableStatisticsKHR")
        count = ffi.new("uint32_t*")
        check(get(dev.handle, exe, count, NULL), "vkGetPipelineExecutableStatisticsKHR")
        stats = ffi.new(f"VkPipelineExecutableStatisticKHR[{count[0]}]")
        for i in range(count[0]):
            stats[i].sType = vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR
        check(get(dev.handle, exe, count, stats), "vkGetPipelineExecutableStatisticsKHR")
        out: dict[str, float] = {}
        for i in range(count[0]):
            st = stats[i]
            fmt = st.format
            if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR:
                v: float = float(st.value.b32)
            elif fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR:
                v = float(st.value.i64)
            elif fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR:
                v = float(st.value.u64)
            else:
                v = float(st.value.f64)
            out[ffi.string(st.name).decode(errors="replace")] = v
        return out

    @classmethod
    def get(cls, device: Device, name: str) -> Kernel:
        """The device's kernel for ``name`` (made once, owned by the device)."""
        cache: dict[str, Kernel] = device.__dict__.setdefault("_kernels", {})
        k = cache.get(name)
        if k is None or k.pipeline is None:
            k = cache[name] = cls(device, name)
        return k

    def pack(self, *values: Any) -> bytes:
        """Push-constant bytes for ``values`` in the manifest's layout."""
        try:
            return struct.pack(self.push_format, *values)
        except struct.error as exc:
            raise KernelError(f"kernel {self.name}: push constants {values} do not fit "
                              f"layout {self.push_format!r}: {exc}") from exc

    def descriptor_set(self, bindings: list[Bindable]) -> Any:
        """A descriptor set binding ``bindings`` (cached per distinct set of ranges)."""
        if len(bindings) != self.bindings:
            raise KernelError(f"kernel {self.name} takes {self.bindings} buffers, got {len(bindings)}")
        ranges = [as_range(b) for b in bindings]
        key = tuple((serial, o, s) for _h, o, s, serial in ranges)
        ds = self._sets.get(key)
        if ds is not None:
            return ds
        maxr = int(self.device.physical.limits["maxStorageBufferRange"])
        for i, (_h, _o, s, _) in enumerate(ranges):
            if s > maxr:
                raise KernelError(f"kernel {self.name}: binding {i} is {s} bytes, over the device's "
                                  f"maxStorageBufferRange ({maxr})")
        ds = self._allocate_set()
        infos = ffi.new(f"VkDescriptorBufferInfo[{self.bindings}]")
        writes = ffi.new(f"VkWriteDescriptorSet[{self.bindings}]")
        wst = new("VkWriteDescriptorSet").sType
        for i, (h, o, s, _) in enumerate(ranges):
            infos[i].buffer = h
            infos[i].offset = o
            infos[i].range = s
            writes[i].sType = wst
            writes[i].dstSet = ds
            writes[i].dstBinding = i
            writes[i].descriptorCount = 1
            writes[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            writes[i].pBufferInfo = infos + i
        lib.vkUpdateDescriptorSets(self.device.handle, self.bindings, writes, 0, NULL)
        self._sets[key] = ds
        return ds

    def _allocate_set(self) -> Any:
        if self._pool_left == 0:
            n = 64 if not self._pools else 256
            size = new("VkDescriptorPoolSize", type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                       descriptorCount=n * self.bindings)
            dpci = new("VkDescriptorPoolCreateInfo", maxSets=n, poolSizeCount=1, pPoolSizes=size)
            pool = ffi.new("VkDescriptorPool*")
            check(lib.vkCreateDescriptorPool(self.device.handle, dpci, NULL, pool), "vkCreateDescriptorPool")
            self._pools.append(pool[0])
            self._pool_left = n
        ai = new("VkDescriptorSetAllocateInfo", descriptorPool=self._pools[-1], descriptorSetCount=1,
                 pSetLayouts=self._set_layouts)
        out = ffi.new("VkDescriptorSet*")
        check(lib.vkAllocateDescriptorSets(self.device.handle, ai, out), "vkAllocateDescriptorSets")
        self._pool_left -= 1
        return out[0]

    def forget_sets(self) -> None:
        """Drop cached descriptor sets (after the buffers they name were freed)."""
        d = self.device.handle
        for p in self._pools:
            lib.vkDestroyDescriptorPool(d, p, NULL)
        self._pools.clear()
        self._sets.clear()
        self._pool_left = 0

    def close(self) -> None:
        d = self.device.handle
        if d is None or self.pipeline is None:
            return
        self.forget_sets()
        lib.vkDestroyPipeline(d, self.pipeline, NULL)
        lib.vkDestroyPipelineLayout(d, self.layout, NULL)
        lib.vkDestroyDescriptorSetLayout(d, self.set_layout, NULL)
        lib.vkDestroyShaderModule(d, self.module, NULL)
        self.pipeline = None
        self.device.disown(self)

    def __repr__(self) -> str:
        return f"Kernel({self.name})"
