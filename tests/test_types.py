"""The one ggml type table (vkxsplit.ops.quant): block facts for every ggml type, row sizes,
and the modules that used to keep their own copies now asking it."""

from __future__ import annotations

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from vkxsplit import backend
from vkxsplit.errors import KernelError
from vkxsplit.gguf_model import SUPPORTED_TYPES
from vkxsplit.ops import quant
from vkxsplit.plan import workspace


def test_type_info_is_ggmls_for_every_type() -> None:
    for t in GGMLQuantizationType:
        if t not in GGML_QUANT_SIZES:
            continue
        assert quant.type_info(t) == GGML_QUANT_SIZES[t] == quant.type_info(t.name.lower())


def test_row_bytes_for_types_with_and_without_kernels() -> None:
    assert quant.row_bytes("q4_0", 4096) == 4096 // 32 * 18  # 18-byte blocks of 32
    assert quant.row_bytes("q6_k", 4096) == 16 * 210
    assert quant.row_bytes("IQ4_NL", 64) == 2 * 18  # no hub kernel, still a known ggml type
    assert quant.row_bytes("f16", 7) == 14
    with pytest.raises(KernelError, match="not a whole number"):
        quant.row_bytes("q4_k", 300)
    with pytest.raises(KernelError, match="unknown ggml type"):
        quant.type_info("q9_9")


def test_one_table_serves_every_module() -> None:
    assert backend.row_bytes is quant.row_bytes and backend.ggml_type_info is quant.type_info
    assert workspace.ELEM_BYTES is quant.ELEM_BYTES and workspace.FLOAT_TYPES is quant.FLOAT_TYPES
    assert SUPPORTED_TYPES == {t.ggml for t in quant.TYPES.values()}
