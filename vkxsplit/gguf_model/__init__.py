"""Load a GGUF model file (memory-mapped) into a :class:`ModelFile`.

The loader is pure Python/numpy over one read-only memory map of the file: the metadata and the
tensor table come from the checked header walk of :mod:`vkxsplit.gguf_header` (gguf-py's
``GGUFReader``, which builds numpy objects for every part of every value, is not used; gguf-py
stays the library that writes files and the tests' reference). It reads the architecture's
hyperparameters, describes every tensor (ggml type, shape, byte range in the file, a zero-copy
``uint8`` view of its raw bytes) and validates the file before any GPU work starts: a missing
file, a file that is not GGUF, a truncated file, an unsupported architecture or weight type, a
missing or misshapen tensor each raise :class:`~vkxsplit.errors.ModelError` naming the file and
the cause, with a hint.

Shapes come in two orders. ``TensorInfo.ne`` is ggml's order (``ne0`` is the contiguous
dimension, i.e. the row length), padded to four entries with 1. ``TensorInfo.shape`` is numpy's
order (the reverse of the used ``ne``), and ``TensorInfo.rows`` x ``TensorInfo.cols`` is the 2-D
matrix view the kernels use: ``cols == ne0`` and ``rows == ne1 * ne2 * ne3``. A weight matrix of
a linear layer ``y = W @ x`` therefore has ``cols == len(x)`` and ``rows == len(y)``.

The modules, one concern each: :mod:`~vkxsplit.gguf_model.file` (:class:`ModelFile`,
:func:`load_model`), :mod:`~vkxsplit.gguf_model.tensors` (:class:`TensorInfo`, the tensors
read and checked), :mod:`~vkxsplit.gguf_model.metadata` (:class:`~vkxsplit.gguf_model.metadata.Metadata`: values,
arrays decoded when asked),
:mod:`~vkxsplit.gguf_model.hparams` (:data:`ARCHS`, :class:`HParams` per architecture) and
:mod:`~vkxsplit.gguf_model.checks` (tensor shapes and vocabulary against the
hyper-parameters). This package re-exports their public names.
"""

from __future__ import annotations

from ..gguf_header import GGUF_MAGIC_BYTES
from .checks import LAYER_BIASES, LAYER_TENSORS
from .file import ModelFile, default_model_path, load_model
from .hparams import ARCHS, SUPPORTED_ARCHS, SUPPORTED_ROPE_SCALING, ArchInfo, HParams
from .tensors import SUPPORTED_TYPES, TensorInfo

__all__ = [
    "ARCHS",
    "GGUF_MAGIC_BYTES",
    "LAYER_BIASES",
    "LAYER_TENSORS",
    "SUPPORTED_ARCHS",
    "SUPPORTED_ROPE_SCALING",
    "SUPPORTED_TYPES",
    "ArchInfo",
    "HParams",
    "ModelFile",
    "TensorInfo",
    "default_model_path",
    "load_model",
]
