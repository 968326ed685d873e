"""Access to the Vulkan loader through the ``vulkan`` package's cffi ``ffi``/``lib``.

vkxsplit calls ``lib`` directly with structs made by :func:`new`: the package's Python
wrappers cost microseconds per call and free nested structs too early (see
../shared/gpu/README.md). Rule for every caller: keep each struct, array and string that a
call points to in a local variable until the call returns.
"""

from __future__ import annotations

import inspect
import itertools
from functools import cache
from typing import Any

from ..errors import EnvironmentProblem, OutOfDeviceMemory, VulkanError
from .result import version_str  # noqa: F401 (the api surface: vk.api.version_str)

try:
    import vulkan as vk  # the cffi binding: constants, ffi, lib
except OSError as exc:  # raised by the package when dlopen(libvulkan.so.1) fails
    raise EnvironmentProblem(
        "no Vulkan loader: libvulkan.so.1 could not be loaded",
        "install it: apt-get install libvulkan1 mesa-vulkan-drivers (or your GPU vendor's driver)",
    ) from exc
except ImportError as exc:
    raise EnvironmentProblem(
        f"the Python package 'vulkan' is missing ({exc})",
        "pip install vulkan==1.3.275.1 (or reinstall vkxsplit)",
    ) from exc

ffi = vk.ffi
lib = vk.lib

NULL = ffi.NULL
UINT64_MAX = 0xFFFFFFFFFFFFFFFF


@cache
def _stype(ctype: str) -> int | None:
    ctor = getattr(vk, ctype, None)
    if ctor is None:
        return None
    try:
        p = inspect.signature(ctor).parameters.get("sType")
    except (TypeError, ValueError):
        return None
    return None if p is None else p.default


def new(ctype: str, **fields: Any) -> Any:
    """``ffi.new(ctype *)`` with ``sType`` filled in and the given fields set.

    Pointer fields must be cdata the caller keeps alive until the Vulkan call returns.
    """
    p = ffi.new(ctype + "*")
    st = _stype(ctype)
    if st is not None and "sType" in dict(ffi.typeof(ctype).fields):
        p.sType = st
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def array(ctype: str, items: list[Any]) -> Any:
    """A C array ``ctype[len(items)]`` (at least one element) filled with ``items``.

    For struct element types pass the structs themselves (``p[0]``), they are copied in.
    """
    arr = ffi.new(f"{ctype}[{max(1, len(items))}]")
    for i, it in enumerate(items):
        arr[i] = it
    return arr


def cstr(s: str) -> Any:
    return ffi.new("char[]", s.encode())


def string(chars: Any) -> str:
    return ffi.string(chars).decode(errors="replace")


def check(result: int, call: str, hint: str = "") -> int:
    """Raise a :class:`VulkanError` for negative results; return the (non-negative) result."""
    if result < 0:
        if result == vk.VK_ERROR_OUT_OF_DEVICE_MEMORY:
            raise OutOfDeviceMemory(
                call, result, hint or "the device is out of memory: use a smaller model or batch, "
                "or free other GPU work")
        raise VulkanError(call, result, hint)
    return result


def enumerate_(fn: Any, ctype: str, *args: Any) -> list[Any]:
    """The two-call enumerate idiom: a list of owned items (handles as values, structs each in
    its own allocation). Never a slice of the call's array: a cffi slice does not keep the
    array alive, and reading it after the array is freed read garbage handles (a crash in
    vkGetPhysicalDeviceProperties on the 2-GPU H200 machine)."""
    n = ffi.new("uint32_t*")
    check(fn(*args, n, NULL), getattr(fn, "__name__", "vkEnumerate"))
    if not n[0]:
        return []
    arr = ffi.new(f"{ctype}[{n[0]}]")
    st = _stype(ctype)
    if st is not None:
        for i in range(n[0]):
            arr[i].sType = st
    check(fn(*args, n, arr), getattr(fn, "__name__", "vkEnumerate"))
    if ffi.typeof(arr).item.kind == "struct":
        out = []
        for i in range(n[0]):
            item = ffi.new(f"{ctype}*")
            item[0] = arr[i]  # a copy the list owns
            out.append(item)
        return out
    return [arr[i] for i in range(n[0])]  # handles / scalars: values


def make_version(major: int, minor: int, patch: int = 0) -> int:
    return (major << 22) | (minor << 12) | patch


API_1_1 = make_version(1, 1)
API_1_2 = make_version(1, 2)
API_1_3 = make_version(1, 3)


_serial = itertools.count(1)


def next_serial() -> int:
    """A process-wide creation counter: owners destroy children newest first."""
    return next(_serial)
