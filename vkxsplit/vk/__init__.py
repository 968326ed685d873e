"""The Vulkan layer: the hub every backend attaches to.

Modules, in the order a step meets them:

- :mod:`.api`: loads the loader through the ``vulkan`` cffi package; struct and error helpers
- :mod:`.instance`: instance, validation layer, physical-device discovery
- :mod:`.device`: the logical device (the hub): features, queues, extension functions
- :mod:`.memory`: block sub-allocator, buffers and their numpy views, exportable pools
- :mod:`.event`: timeline semaphores with host wait/signal and timeouts
- :mod:`.kernel`: compute pipelines from the shipped SPIR-V, descriptor sets
- :mod:`.command`: command sequences recorded once and replayed, submits
"""
