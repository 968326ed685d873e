"""vkxsplit: a Vulkan-centric async runtime that splits LLM inference across accelerators.

Where to find each concept (one module each):

- ``vkxsplit.vk.instance`` / ``vkxsplit.vk.device``: the Vulkan hub (instance, physical device, queues)
- ``vkxsplit.vk.memory``: the sub-allocating memory manager and buffers mapped to numpy
- ``vkxsplit.vk.event``: timeline semaphores (the events every backend synchronises on)
- ``vkxsplit.vk.kernel``: compute pipelines made from the shipped SPIR-V
- ``vkxsplit.vk.command``: command buffers recorded once and replayed
- ``vkxsplit.shaders``: the shader build step, variant grammar and manifest
- ``vkxsplit.ops``: one Python entry per op that records its kernel into a command buffer
"""

from __future__ import annotations

from .errors import VkxError

__version__ = "0.1.0"

__all__ = ["VkxError", "__version__"]
