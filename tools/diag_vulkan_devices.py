#!/usr/bin/env python3
"""Diagnose physical-device enumeration one call at a time (for a crash inside a driver):
prints each step before making it, so the last line names the call that crashed."""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
faulthandler.enable()

from vkxsplit.vk.api import NULL, check, ffi, lib, new, string  # noqa: E402


def main() -> int:
    app = new("VkApplicationInfo", apiVersion=(1 << 22) | (3 << 12))
    ci = new("VkInstanceCreateInfo", pApplicationInfo=app)
    inst = ffi.new("VkInstance*")
    print("vkCreateInstance", flush=True)
    check(lib.vkCreateInstance(ci, NULL, inst), "vkCreateInstance")
    n = ffi.new("uint32_t*")
    check(lib.vkEnumeratePhysicalDevices(inst[0], n, NULL), "count")
    print("devices:", n[0], flush=True)
    arr = ffi.new(f"VkPhysicalDevice[{n[0]}]")
    check(lib.vkEnumeratePhysicalDevices(inst[0], n, arr), "enumerate")
    for i in range(n[0]):
        print(f"device {i}: handle {arr[i]}", flush=True)
        props = ffi.new("VkPhysicalDeviceProperties*")
        print(f"device {i}: vkGetPhysicalDeviceProperties", flush=True)
        lib.vkGetPhysicalDeviceProperties(arr[i], props)
        print(f"device {i}: {string(props.deviceName)} api {props.apiVersion >> 22}.{(props.apiVersion >> 12) & 1023}",
              flush=True)
    from vkxsplit.vk import instance as vi

    for i in range(n[0]):
        print(f"device {i}: coopmat shapes", flush=True)
        print(f"device {i}: {len(vi._query_coopmat_shapes(inst[0], arr[i]))} shapes", flush=True)
    for i in range(n[0]):
        print(f"device {i}: _query_device", flush=True)
        info = vi._query_device(i, arr[i], inst[0])
        print(f"device {i}: {info.name}, {len(info.extensions)} extensions", flush=True)
    lib.vkDestroyInstance(inst[0], NULL)
    print("vkxsplit Instance().physical_devices()", flush=True)
    with vi.Instance(validation=False) as inst2:
        print([d.name for d in inst2.physical_devices()], flush=True)
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
