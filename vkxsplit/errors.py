"""The error types vkxsplit raises.

Every error a user can cause or meet (missing driver, bad GGUF, unsupported quant type, a
timeout, a dead backend) is a :class:`VkxError` with a message naming the cause and a ``hint``
saying what to do. The CLI prints those two lines and exits non-zero; it never shows a
traceback for them.
"""

from __future__ import annotations


class VkxError(Exception):
    """Base class: ``str(err)`` names the cause, ``err.hint`` says what to do about it."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg}\n  hint: {self.hint}" if self.hint else msg


class EnvironmentProblem(VkxError):
    """The machine lacks something: a Vulkan loader, a device, a feature, a package."""

    exit_code = 3


class VulkanError(VkxError):
    """A Vulkan call returned an error code."""

    def __init__(self, call: str, result: int, hint: str = "") -> None:
        from .vk.result import result_name

        self.call = call
        self.result = result
        super().__init__(f"{call} failed with {result_name(result)} ({result})", hint)


class OutOfDeviceMemory(VulkanError):
    """An allocation did not fit in the device's memory."""


class KernelError(VkxError):
    """An op, weight type or shape that no kernel handles (raised at plan time)."""


class ShaderBuildError(VkxError):
    """The shader build step or the shipped SPIR-V is broken."""


class WaitTimeout(VkxError):
    """A wait on a timeline point did not complete in time."""


class BackendDied(VkxError):
    """An attached backend (process, thread or device) stopped answering."""


class ModelError(VkxError):
    """A GGUF file is corrupt, truncated or of an unsupported architecture or type."""


class PlanError(VkxError):
    """A split specification that cannot be planned."""
