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
    """An attached backend is gone: its process exited, its connection closed, its thread ended
    (or, as :class:`BackendStalled`, it was given up on after making no progress)."""


class Stalled(WaitTimeout):
    """A wait saw no progress (its counter, the peers it watches, the hub's activity) for the
    stall limit while every peer it watches was still alive: slow or wedged, not dead."""


class BackendStalled(Stalled, BackendDied):
    """A backend alive but without progress for the stall limit; the host bridge gives up on it
    (its pending values are signalled), so it is also a :class:`BackendDied` for callers."""


class ModelError(VkxError):
    """A GGUF file is corrupt, truncated or of an unsupported architecture or type."""


class PlanError(VkxError):
    """A split specification that cannot be planned."""


class ClosedError(VkxError):
    """A public method of an object that was closed (a model, device, buffer, timeline,
    backend, tokenizer): the one error for use after ``close()``."""


class Closable:
    """Mixin giving one rule for use after close: once ``close()`` has returned, every public
    method and property of the class (names without a leading underscore, and those listed in
    ``_closed_guards``) raises :class:`ClosedError`; ``close()`` itself may be called again and
    does nothing. Subclasses get the same wrapping (``__init_subclass__``), so a backend or model
    subclass needs no code of its own. ``closed`` says whether the object was closed.

    A ``close()`` that calls ``super().close()`` runs the base class's close normally (only the
    outermost call marks the object closed); the object counts as closed even when its close
    raised half-way (it must not be used then either)."""

    _vkx_closed: bool = False
    _vkx_closing: bool = False
    #: private methods that must raise after close too (e.g. a step that a generator resumes)
    _closed_guards: tuple[str, ...] = ()
    #: public names that stay usable after close (teardown helpers other objects call, names)
    _closed_exempt: tuple[str, ...] = ("name",)
    #: how the error names the object (default: the class name)
    _closed_what: str = ""

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        for name, attr in list(vars(cls).items()):
            if name == "close" and callable(attr):
                setattr(cls, name, _guard_close(attr))
            elif (name in ("closed", *cls._closed_exempt)
                  or (name.startswith("_") and name not in cls._closed_guards)):
                continue
            elif isinstance(attr, property) and attr.fget is not None:
                setattr(cls, name, property(_guard_method(attr.fget, name), attr.fset, attr.fdel, attr.__doc__))
            elif callable(attr) and not isinstance(attr, (type, staticmethod, classmethod)):
                setattr(cls, name, _guard_method(attr, f"{name}()"))

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (every public method then raises :class:`ClosedError`)."""
        return self._vkx_closed

    def _closed_error(self, name: str) -> ClosedError:
        what = self._closed_what or type(self).__name__
        label = getattr(self, "name", None)
        if isinstance(label, str) and label:
            what = f"{what} {label!r}"
        return ClosedError(f"{what} is closed: {name} cannot be used after close()",
                           "keep the object open while you use it (or anything taken from it), or "
                           "make a new one")

    def _check_open(self, name: str = "this object") -> None:
        if self._vkx_closed:
            raise self._closed_error(name)


def _guard_method(fn: object, name: str) -> object:
    import functools

    @functools.wraps(fn)  # type: ignore[arg-type]
    def guarded(self: Closable, *a: object, **kw: object) -> object:
        if self._vkx_closed:
            raise self._closed_error(name)
        return fn(self, *a, **kw)  # type: ignore[operator]

    guarded.__vkx_guarded__ = True  # type: ignore[attr-defined]
    return guarded


def _guard_close(fn: object) -> object:
    import functools

    if getattr(fn, "__vkx_guarded__", False):
        return fn

    @functools.wraps(fn)  # type: ignore[arg-type]
    def close(self: Closable, *a: object, **kw: object) -> object:
        if self._vkx_closed:
            return None  # idempotent
        if self._vkx_closing:  # super().close() from a subclass's close, or close from a hook
            return fn(self, *a, **kw)  # type: ignore[operator]
        self._vkx_closing = True
        try:
            return fn(self, *a, **kw)  # type: ignore[operator]
        finally:
            self._vkx_closed = True
            self._vkx_closing = False

    close.__vkx_guarded__ = True  # type: ignore[attr-defined]
    return close
