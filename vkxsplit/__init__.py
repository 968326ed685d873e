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
- ``vkxsplit.backend`` / ``vkxsplit.attach``: attached backends and shared memory
- ``vkxsplit.plan``: the split planner (layer, tensor, mode splits over attached backends)
- ``vkxsplit.pipeline``: a model's layers over several GPUs, one hub each
"""

from __future__ import annotations

from typing import Any

from .errors import VkxError

__version__ = "0.1.0"

__all__ = ["VkxError", "__version__", "load_model"]


def load_model(path: Any = None, split: Any = None, backends: Any = None, **kw: Any) -> Any:
    """Load a GGUF model onto the hub (default: SmolLM2-135M-Instruct Q4_1); see
    :class:`vkxsplit.model.Model` for the API (tokenize, detokenize, logits, generate, close).
    ``devices=[...]`` (two or more): the layers split over those GPUs, one hub each
    (:class:`vkxsplit.pipeline.PipelineModel`, which takes ``layer_split``, ``micro_batches``);
    with ``split_mode="row"`` every matrix split by rows over two GPUs
    (:class:`vkxsplit.tensor_split.TensorSplitModel`)."""
    devices = kw.pop("devices", None)
    split_mode = kw.pop("split_mode", "layer")
    if split_mode not in ("layer", "row"):
        raise VkxError(f"split_mode {split_mode!r} is not 'layer' or 'row'")
    if devices is not None:
        if split not in (None, "none") or backends or "device" in kw:
            raise VkxError("devices=[...] puts one hub on each device: no split, backends or device with it")
        if split_mode == "row":
            from .tensor_split import TensorSplitModel

            extra = sorted(set(kw) & {"layer_split", "micro_batches"})
            if extra:
                raise VkxError(f"{', '.join(extra)} go with split_mode='layer' (the pipeline)")

            return TensorSplitModel(path, devices=devices, **kw)
        from .pipeline import PipelineModel

        return PipelineModel(path, devices=devices, **kw)
    if split_mode != "layer":
        raise VkxError("split_mode='row' goes with devices=[...] (a model split over two GPUs)")
    from .model import load_model as _load

    return _load(path, split=split, backends=backends, **kw)
