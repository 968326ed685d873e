"""Presentation support for ``vkxsplit info --surface``: a GLFW session with one hidden window
(:class:`_Glfw`) and, per device, the queue families that can present to its surface, the
surface formats, present modes and capabilities.
"""

from __future__ import annotations

from typing import Any

from .names import _enum_names


class _Glfw:
    """A GLFW session with one hidden NO_API window (for ``--surface``)."""

    def __init__(self) -> None:
        self.glfw: Any = None
        self.window: Any = None
        self.errors: list[str] = []
        self.extensions: list[str] = []
        self.version = ""

    def open(self) -> str:
        """Returns "" when ready, else why not."""
        try:
            import glfw
        except Exception as exc:
            return f"the Python package glfw is not usable ({exc}); pip install glfw"
        self.glfw = glfw
        glfw.set_error_callback(lambda code, desc: self.errors.append(
            desc.decode(errors="replace") if isinstance(desc, bytes) else str(desc)))
        try:
            self.version = glfw.get_version_string().decode(errors="replace")
        except Exception:
            self.version = ""
        if not glfw.init():
            self.glfw = None
            why = "; ".join(self.errors) or "glfwInit failed"
            return f"no display: {why}"
        if not glfw.vulkan_supported():
            return "GLFW found no Vulkan loader (glfwVulkanSupported is false)"
        self.extensions = list(glfw.get_required_instance_extensions() or [])
        if not self.extensions:
            return "GLFW reports no Vulkan surface extensions for this platform"
        glfw.window_hint(glfw.CLIENT_API, glfw.NO_API)
        glfw.window_hint(glfw.VISIBLE, glfw.FALSE)
        self.window = glfw.create_window(64, 64, "vkxsplit info", None, None)
        if not self.window:
            return "could not create a window: " + ("; ".join(self.errors) or "unknown error")
        return ""

    def platform(self) -> str:
        g = self.glfw
        if g is None or not hasattr(g, "get_platform"):
            return ""
        names = {getattr(g, n, None): n[len("PLATFORM_"):].lower()
                 for n in ("PLATFORM_WIN32", "PLATFORM_COCOA", "PLATFORM_WAYLAND", "PLATFORM_X11",
                           "PLATFORM_NULL")}
        try:
            return names.get(g.get_platform(), "")
        except Exception:
            return ""

    def close(self) -> None:
        if self.glfw is None:
            return
        if self.window:
            self.glfw.destroy_window(self.window)
            self.window = None
        self.glfw.terminate()
        self.glfw.set_error_callback(None)
        self.glfw = None


def _surface_per_device(inst: Any, gl: _Glfw, devices: list[Any]) -> tuple[str, dict[int, Any]]:
    from ..vk.api import NULL, check, enumerate_, ffi, string  # noqa: F401

    surf = ffi.new("VkSurfaceKHR*")
    res = gl.glfw.create_window_surface(inst.handle, gl.window, None, surf)
    if res != 0:
        from ..vk.result import result_name

        return f"glfwCreateWindowSurface failed with {result_name(res)}", {}
    surface = surf[0]
    formats = _enum_names("VK_FORMAT_")
    spaces = _enum_names("VK_COLOR_SPACE_")
    modes = _enum_names("VK_PRESENT_MODE_")
    out: dict[int, Any] = {}
    try:
        support_fn = inst.proc("vkGetPhysicalDeviceSurfaceSupportKHR")
        formats_fn = inst.proc("vkGetPhysicalDeviceSurfaceFormatsKHR")
        modes_fn = inst.proc("vkGetPhysicalDeviceSurfacePresentModesKHR")
        caps_fn = inst.proc("vkGetPhysicalDeviceSurfaceCapabilitiesKHR")
        for p in devices:
            d: dict[str, Any] = {}
            sup = ffi.new("VkBool32*")
            d["presentation_support"] = []
            for q in p.queue_families:
                check(support_fn(p.handle, q.index, surface, sup), "vkGetPhysicalDeviceSurfaceSupportKHR")
                d["presentation_support"].append(bool(sup[0]))
            fmts = enumerate_(formats_fn, "VkSurfaceFormatKHR", p.handle, surface)
            d["formats"] = [{"format": formats.get(f.format, str(f.format)),
                             "color_space": spaces.get(f.colorSpace, str(f.colorSpace))} for f in fmts]
            pms = enumerate_(modes_fn, "VkPresentModeKHR", p.handle, surface)
            d["present_modes"] = [modes.get(int(m), str(int(m))) for m in pms]
            caps = ffi.new("VkSurfaceCapabilitiesKHR*")
            check(caps_fn(p.handle, surface, caps), "vkGetPhysicalDeviceSurfaceCapabilitiesKHR")
            d["capabilities"] = {"min_image_count": caps.minImageCount, "max_image_count": caps.maxImageCount,
                                 "current_extent": [caps.currentExtent.width, caps.currentExtent.height]}
            out[p.index] = d
    finally:
        inst.proc("vkDestroySurfaceKHR")(inst.handle, surface, NULL)
    return "", out
