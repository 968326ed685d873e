"""``vkxsplit info``: what this machine can split with what (a vulkaninfo for bug reports).

Sections: the Vulkan instance (loader, layers, drivers), each physical device (properties,
memory, queues, the features that pick kernels, cooperative-matrix shapes, extensions,
external-handle interop), which shipped kernels each device runs, the backends that could
attach, and the attach matrix: per backend, the memory and event path it gets with a given
hub device and why nothing better is available. ``--json`` prints the same as one JSON
document whose schema is in docs/INFO.md (``schema_version`` changes on incompatible edits).

No module of this package imports anything from Vulkan at import time: the CLI imports it to
build its parser, and a machine without a Vulkan loader must still get a clean error message.

The modules, one concern each: :mod:`~vkxsplit.info.names` (names for Vulkan numbers),
:mod:`~vkxsplit.info.backends` (the backends found), :mod:`~vkxsplit.info.matrix` (the attach
matrix), :mod:`~vkxsplit.info.kernels` (the kernels each device runs, the shader manifest),
:mod:`~vkxsplit.info.surface` (``--surface``), :mod:`~vkxsplit.info.report` (the report as
data: :func:`collect`), :mod:`~vkxsplit.info.render` (the report as text) and
:mod:`~vkxsplit.info.command` (the subcommand). This package re-exports their public names.
"""

from __future__ import annotations

from .backends import device_nodes, probe_backends
from .command import register
from .kernels import kernel_report, prefill_report, shader_report
from .matrix import EVENT_PATHS, MEMORY_PATHS, PATH_LABELS, attach_matrix, probe_opaque_fd_mappable
from .names import (
    COMPONENT_TYPES,
    DEVICE_TYPES,
    MEMORY_HEAP_FLAGS,
    MEMORY_PROPERTY_FLAGS,
    QUEUE_FLAGS,
    SCOPES,
    SHADER_STAGE_COMPUTE,
    SUBGROUP_OPS,
    VENDORS,
    driver_version_str,
    flag_names,
)
from .render import WIDTH, render_text
from .report import (
    ENV_VARS,
    ICD_DIRS,
    INSTANCE_EXTENSIONS_OF_INTEREST,
    SCHEMA_VERSION,
    collect,
    icd_manifests,
    multi_gpu_report,
)

__all__ = [
    "COMPONENT_TYPES",
    "DEVICE_TYPES",
    "ENV_VARS",
    "EVENT_PATHS",
    "ICD_DIRS",
    "INSTANCE_EXTENSIONS_OF_INTEREST",
    "MEMORY_HEAP_FLAGS",
    "MEMORY_PATHS",
    "MEMORY_PROPERTY_FLAGS",
    "PATH_LABELS",
    "QUEUE_FLAGS",
    "SCHEMA_VERSION",
    "SCOPES",
    "SHADER_STAGE_COMPUTE",
    "SUBGROUP_OPS",
    "VENDORS",
    "WIDTH",
    "attach_matrix",
    "collect",
    "device_nodes",
    "driver_version_str",
    "flag_names",
    "icd_manifests",
    "kernel_report",
    "multi_gpu_report",
    "prefill_report",
    "probe_backends",
    "probe_opaque_fd_mappable",
    "register",
    "render_text",
    "shader_report",
]
