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


NEW = ("q2_k", "q3_k", "iq4_nl", "iq4_xs")


def test_kernel_type_ids_match_the_shaders() -> None:
    """Every type with hub kernels has its ggml id as a WT_ define in shaders/ggml_types.glsl
    (the WTYPE the variants are built with), the new ones included."""
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parent.parent / "shaders" / "ggml_types.glsl").read_text()
    ids = {m[0].lower(): int(m[1]) for m in re.findall(r"#define WT_(\w+) (\d+)", src)}
    assert ids == {t: wt.id for t, wt in quant.TYPES.items()}
    assert all(t in quant.TYPES for t in NEW)


def test_unsupported_type_names_itself_and_the_supported_list() -> None:
    for bad in ("IQ2_XXS", GGMLQuantizationType.IQ3_S, int(GGMLQuantizationType.TQ1_0)):
        with pytest.raises(KernelError) as err:
            quant.weight_type(bad)
        name = bad if isinstance(bad, str) else GGMLQuantizationType(int(bad)).name
        msg = str(err.value)
        assert name in msg and "supported: " in msg
        assert all(t.upper() in msg for t in quant.TYPES)


@pytest.mark.parametrize("t", NEW)
def test_synth_writes_the_new_types(tmp_path, t: str) -> None:
    """``vkxsplit synth --type`` takes the new types: matrices of rows of whole 256-element
    super-blocks in the type itself (else llama.cpp's IQ4_NL fallback), values of about
    WEIGHT_STD by gguf's dequantize, every value finite."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from vkxsplit import synth

    p = tmp_path / f"{t}.gguf"
    synth.write_synthetic(p, "tiny", t, n_layer=1)
    r = GGUFReader(p)
    got = {x.name: x for x in r.tensors}
    w = got["blk.0.ffn_up.weight"]
    assert w.tensor_type.name.lower() == t
    vals = dequantize(np.asarray(w.data), w.tensor_type)
    assert np.isfinite(vals).all() and 0.5 * synth.WEIGHT_STD < float(np.std(vals)) < 2 * synth.WEIGHT_STD
    # 576-element rows hold no super-blocks: IQ4_NL (llama.cpp's fallback for the three others)
    assert synth.synthetic_tensor_types("smol135m", t, n_layer=1)["blk.0.attn_q.weight"].name == "IQ4_NL"
