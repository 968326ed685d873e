"""vkxsplit: a Vulkan-centric async runtime that splits LLM inference across accelerators.

Where to find each concept (one module each):

- ``vkxsplit.vk.instance`` / ``vkxsplit.vk.device``: the Vulkan hub (instance, physical device, queues)
- ``vkxsplit.vk.memory``: the sub-allocating memory manager and buffers mapped to numpy
- ``vkxsplit.vk.event``: timeline semaphores (the events every backend synchronises on)
- ``vkxsplit.vk.kernel``: compute pipelines made from the shipped SPIR-V
- ``vkxsplit.vk.command``: command buffers recorded once and replayed
- ``vkxsplit.shaders``: the shader build step, variant grammar and manifest
- ``vkxsplit.ops``: one Python entry per op that records its kernel into a command buffer
- ``vkxsplit.graph`` / ``vkxsplit.executor``: the step as a graph, recorded into a sequence
- ``vkxsplit.gguf_model`` / ``vkxsplit.tokenizer`` / ``vkxsplit.model``: GGUF file to logits
  (``vkxsplit.generation``: the API a user calls; ``vkxsplit.placement``: the hubs, backends and
  what each hub holds, placed at load; ``vkxsplit.model``: the load, the steps, close)
- ``vkxsplit.backend`` / ``vkxsplit.attach``: attached backends and shared memory
- ``vkxsplit.plan``: the split planner (layer, tensor, mode, auto splits over attached backends,
  or layer and row splits over several hubs; one concern per module, ``vkxsplit/plan/__init__.py``)
- ``vkxsplit.hubs``: what each hub of a model holds (one hub per GPU: layer ranges or row shards)
"""

from __future__ import annotations

from typing import Any

from .errors import VkxError

__version__ = "0.1.0"

__all__ = ["VkxError", "__version__", "load_model"]


def load_model(path: Any = None, split: Any = None, backends: Any = None, **kw: Any) -> Any:
    """Load a GGUF model onto the hub (default: SmolLM2-135M-Instruct Q4_1); see
    :class:`vkxsplit.model.Model` for the API (tokenize, detokenize, logits, generate, close).
    ``devices=[...]``: one hub per device, each a participant of the planner; llama.cpp's
    ``split_mode="layer"`` (default: the layers as a pipeline over the hubs, ``layer_split``
    shares, ``micro_batches``) or ``"row"`` (every matrix by rows over two hubs), or the split
    spec itself (``split="layer:3,1"``, ``"tensor:1,1"``)."""
    from .plan.spec import hub_split

    devices = kw.pop("devices", None)
    split_mode = kw.pop("split_mode", None)
    layer_split = kw.pop("layer_split", None)
    if split_mode not in (None, "layer", "row"):
        raise VkxError(f"split_mode {split_mode!r} is not 'layer' or 'row'")
    if devices is None:
        if split_mode is not None or layer_split is not None or "micro_batches" in kw:
            raise VkxError("split_mode, layer_split and micro_batches go with devices=[...] (a model over several "
                           "hubs)", "e.g. load_model(path, devices='0,1', split_mode='row')")
        from .model import load_model as _load

        return _load(path, split=split, backends=backends, **kw)
    if backends or "device" in kw:
        raise VkxError("devices=[...] puts one hub on each device: no backends or device with it")
    if split_mode is not None or layer_split is not None:
        if split not in (None, "none"):
            raise VkxError("split= and split_mode/layer_split both give the split over the hubs", "give one of them")
        split = hub_split(split_mode or "layer", layer_split)
    from .model import Model

    return Model(path, split=split, devices=devices, **kw)
