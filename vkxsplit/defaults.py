"""The one set of defaults the command line (``vkxsplit run``/``serve``/``bench``) and the Python
API (:func:`vkxsplit.load_model`, ``generate``, ``generate_ids``, :class:`~vkxsplit.model.Sampler`)
share: sampling, the chat template, and the split chosen for the machine. The README's defaults
table lists these values; change them here only.

Imports: ``vkxsplit.errors`` only (the model and the runner import this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: tokens to generate; -1: until the end of generation (an end-of-turn token) or a full context,
#: as llama.cpp's ``-n -1``
N_PREDICT = -1
#: the command line's ``-n`` (a short answer by default; ``-n -1`` for no limit)
CLI_N_PREDICT = 64
#: 0 = greedy (reproducible); the other sampling values apply when it is > 0
TEMPERATURE = 0.0
#: llama.cpp's sampling defaults
TOP_K = 40
TOP_P = 0.95
MIN_P = 0.05
#: 1.0 = off (llama.cpp's default since 2024); REPEAT_LAST_N: how many recent tokens it looks at
REPEAT_PENALTY = 1.0
REPEAT_LAST_N = 64
#: the prefill step size (llama.cpp's ``-ub``)
UBATCH = 512


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = TEMPERATURE
    top_k: int = TOP_K
    top_p: float = TOP_P
    min_p: float = MIN_P
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = REPEAT_LAST_N


SAMPLING = SamplingDefaults()


def chat_default(tokenizer: Any) -> bool:
    """Chat wrapping is on exactly when the model file has a chat template
    (``tokenizer.chat_template``); an explicit ``chat=True`` on a file without one uses ChatML."""
    return bool(getattr(tokenizer, "chat_template", None))


#: the split on a CPU hub (lavapipe) with the cpu backend attached: the cpu backend (ggml's CPU
#: kernels, reading the weights in place or repacked) takes every matrix product, decode included
#: (docs/PERFORMANCE.md, "CPU machine", has the measurements behind it)
CPU_HUB_SPLIT = "mode:cpu"
#: the backends beside a CPU hub: the cpu backend also taking the rest of the step (``step=1``:
#: embedding, RoPE, KV store, attention, argmax), so that under :data:`CPU_HUB_SPLIT` the whole
#: step is one run of ggml graphs on the cpu backend and the hub (itself on the same cores) is
#: left nothing; measured against the products-and-glue split (``cpu`` without ``step``) and
#: everything on the hub by ``tools/bench_cpu.py`` (docs/PERFORMANCE.md)
CPU_HUB_BACKENDS = "cpu:step=1"


@dataclass(frozen=True)
class SplitChoice:
    """What :func:`split_for_machine` decided: the split, the backends, and a one-line note for
    the user (empty when nothing was chosen on their behalf; the command line's timing line
    names the split in any case)."""

    split: str | None
    backends: Any
    note: str = ""
    #: the note is a warning (shown by default), not information (shown with -v)
    warn: bool = False


def split_for_machine(split: Any, backends: Any, is_cpu_hub: bool, model_path: str | Path | None = None,
                      hub_name: str = "the hub") -> SplitChoice:
    """The split for this machine and these backends, used by both the command line and
    :func:`vkxsplit.load_model` (one place to change it):

    - a split given: kept as it is;
    - backends given without a split: ``auto`` over what is attached (the planner decides; it
      measures what the device profile lacks on the first steps);
    - neither, on a CPU hub (no GPU: lavapipe): the cpu backend (:data:`CPU_HUB_BACKENDS`) with
      :data:`CPU_HUB_SPLIT` (it reads the hub's weights in place, or a copy in ggml-cpu's repacked
      layout whose stored pages the model gives back: about the file's memory in all);
    - neither, on a GPU: ``none`` (everything on the hub).
    """
    if split is not None:
        return SplitChoice(split, backends)
    if backends:
        return SplitChoice("auto", backends, "vkxsplit: --backends without --split: the planner chooses "
                           "(--split auto over the attached backends)")
    if not is_cpu_hub:
        return SplitChoice(None, backends)
    return SplitChoice(CPU_HUB_SPLIT, CPU_HUB_BACKENDS, f"vkxsplit: '{hub_name}' is a CPU device: the cpu backend "
                       f"runs the step (--split {CPU_HUB_SPLIT} --backends {CPU_HUB_BACKENDS}; --split none keeps "
                       "it on the hub)")


#: how the row split's all-reduce sends its partial sums (``--partials``, ``partials=``): ``auto``
#: (the default: f32 below a size measured once per device, bf16 from it on), or always one type
PARTIALS = ("auto", "f32", "f16", "bf16")


__all__ = ["CLI_N_PREDICT", "CPU_HUB_BACKENDS", "CPU_HUB_SPLIT", "MIN_P", "N_PREDICT", "PARTIALS", "REPEAT_LAST_N",
           "REPEAT_PENALTY", "SAMPLING", "SamplingDefaults", "SplitChoice", "TEMPERATURE", "TOP_K", "TOP_P",
           "UBATCH", "chat_default", "split_for_machine"]
