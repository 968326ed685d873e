"""Hostile inputs: GGUF files and chat templates made to hang, exhaust memory or crash the loader.

The corpus is generated here (a small valid file written with GGUFWriter, then edited byte by
byte), never checked in. Every hostile input must be refused with a ModelError naming the cause,
within 5 s and with under 200 MB of memory growth (measured in a child process: its peak RSS);
``vkxsplit run`` on one must exit non-zero with a one-line cause and no traceback.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter
from test_gguf_model import write_tiny
from test_tokenizer import _tiny_tok

from vkxsplit import gguf_header
from vkxsplit.errors import ModelError
from vkxsplit.gguf_header import GGUF_MAX_ARRAY_DEPTH
from vkxsplit.gguf_model import load_model
from vkxsplit.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN

LIMIT_S = 5.0
LIMIT_MB = 200
ROOT = Path(__file__).resolve().parent.parent

# ---- the base file and its byte layout -----------------------------------------------------------


def _base_kv(w: GGUFWriter) -> None:
    w.add_array("hostile.arr", [1, 2, 3, 4])  # an int array whose count we edit
    w.add_string("hostile.str", "abcdefgh")  # a string whose length we edit
    w.add_array("hostile.nested", [[1, 2], [3]])  # an array of arrays (depth 2: accepted)
    w.add_key_value("hostile.u8", [1, 2, 3], GGUFValueType.ARRAY, GGUFValueType.UINT8)  # gguf-py hangs on a huge u8 count


def write_base(path: Path) -> Path:
    return write_tiny(path, extra_kv=_base_kv)


def _after(data: bytes, marker: bytes) -> int:
    """Offset just past the one occurrence of a length-prefixed ``marker`` string in the header."""
    needle = struct.pack("<Q", len(marker)) + marker
    i = data.find(needle)
    assert i > 0 and data.find(needle, i + 1) < 0, marker
    return i + len(needle)


def _tensor_fields(data: bytes, name: str) -> dict[str, int]:
    """Offsets of the n_dims, dims, type and offset fields of tensor ``name``'s info."""
    p = _after(data, name.encode())
    n_dims = struct.unpack_from("<I", data, p)[0]
    return {"n_dims": p, "dims": p + 4, "type": p + 4 + 8 * n_dims, "offset": p + 8 + 8 * n_dims}


def _u64(data: bytes, at: int) -> int:
    return struct.unpack_from("<Q", data, at)[0]


def _put(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _nested_file(depth: int) -> bytes:
    """A hand-made header: one key whose value nests arrays ``depth`` deep (one element each)."""
    key = b"deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 0, 1) + b"\x07"
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body


def _many_file(n_kv: int, n_tensors: int) -> bytes:
    """A hand-made file of ``n_kv`` one-byte keys and ``n_tensors`` empty F32 tensors: each valid,
    but together more Python objects than any model needs."""
    kv = b"".join(struct.pack("<Q", 7) + b"k%06d" % i + struct.pack("<IB", 0, 1) for i in range(n_kv))
    ti = b"".join(struct.pack("<Q", 7) + b"t%06d" % i + struct.pack("<IQIQ", 1, 0, 0, 0) for i in range(n_tensors))
    data = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + ti
    return data + b"\0" * (-len(data) % 32)


def _arrays_file(n: int) -> bytes:
    """A hand-made header: one key whose value is ``n`` empty uint8 arrays (12 bytes each in the
    file, a numpy array each once read)."""
    body = struct.pack("<Q", 4) + b"many" + struct.pack("<IIQ", 9, 9, n) + struct.pack("<IQ", 0, 0) * n
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body


# name -> (edit of the base file's bytes, fragment the error must contain)
Edit = Callable[[bytes], bytes]


def _arr_count(n: int) -> Edit:
    return lambda d: _put(d, _after(d, b"hostile.arr") + 8, "<Q", n)


def _str_len(n: int) -> Edit:
    return lambda d: _put(d, _after(d, b"hostile.str") + 4, "<Q", n)


def _tensor(name: str, field: str, fmt: str, value: Callable[[bytes, dict[str, int]], int]) -> Edit:
    def edit(d: bytes) -> bytes:
        f = _tensor_fields(d, name)
        return _put(d, f[field], fmt, value(d, f))

    return edit


_Q, _K, _V = "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"


def _rename(d: bytes, old: str, new: str) -> bytes:
    assert len(old) == len(new)
    return d.replace(struct.pack("<Q", len(old)) + old.encode(), struct.pack("<Q", len(new)) + new.encode(), 1)


HOSTILE_FILES: dict[str, tuple[Edit, str]] = {
    "u8_array_count_2^40": (lambda d: _put(d, _after(d, b"hostile.u8") + 8, "<Q", 1 << 40), "claims 1099511627776"),
    "array_count_2^40": (_arr_count(1 << 40), "claims 1099511627776 elements"),
    "array_count_past_end": (_arr_count(1 << 26), "only"),
    "string_len_2^40": (_str_len(1 << 40), "claims 1099511627776 bytes"),
    "string_len_past_end": (_str_len(1 << 20), "truncated or corrupt"),
    "tensor_count_2^40": (lambda d: _put(d, 8, "<Q", 1 << 40), "declares 1099511627776 tensors"),
    "kv_count_2^40": (lambda d: _put(d, 16, "<Q", 1 << 40), "declares 1099511627776 key-value pairs"),
    "tensor_count_plus_one": (lambda d: _put(d, 8, "<Q", _u64(d, 8) + 1), "corrupt"),
    "n_dims_5": (_tensor(_Q, "n_dims", "<I", lambda d, f: 5), "has 5 dimensions"),
    "n_dims_2^31": (_tensor(_Q, "n_dims", "<I", lambda d, f: 1 << 31), "dimensions (at most 4)"),
    "dim_product_overflow": (_tensor(_Q, "dims", "<Q", lambda d, f: 1 << 62), "does not fit in 63 bits"),
    "dim_negative": (_tensor(_Q, "dims", "<Q", lambda d, f: (1 << 64) - 64), "does not fit in 63 bits"),
    "offset_past_end": (_tensor(_Q, "offset", "<Q", lambda d, f: 1 << 40), "needs bytes"),
    "offset_misaligned": (_tensor(_K, "offset", "<Q", lambda d, f: _u64(d, f["offset"]) + 4), "not aligned"),
    "offset_overlapping": (
        _tensor(_K, "offset", "<Q", lambda d, f: _u64(d, _tensor_fields(d, _Q)["offset"])),
        "overlaps tensor",
    ),
    "offset_gap": (_tensor(_K, "offset", "<Q", lambda d, f: _u64(d, f["offset"]) + 32), "expected"),
    "unknown_ggml_type": (_tensor(_Q, "type", "<I", lambda d, f: 999), "ggml type id 999"),
    "invalid_value_type": (lambda d: _put(d, _after(d, b"hostile.str"), "<I", 77), "invalid value type 77"),
    "duplicate_key": (lambda d: _rename(d, "hostile.str", "hostile.arr"), "appears twice"),
    "duplicate_tensor": (lambda d: _rename(d, _K, _V), "appears twice"),
    "name_too_long": (lambda d: _put(d, _after(d, _Q.encode()) - len(_Q) - 8, "<Q", 200), "at most 63"),
    "version_1": (lambda d: _put(d, 4, "<I", 1), "GGUFv1"),
    "version_big_endian": (lambda d: _put(d, 4, "<I", 3 << 24), "big-endian"),
    "version_99": (lambda d: _put(d, 4, "<I", 99), "unsupported GGUF version 99"),
    "nested_depth_3": (lambda d: _nested_file(3), f"deeper than {GGUF_MAX_ARRAY_DEPTH}"),
    "nested_depth_100000": (lambda d: _nested_file(100_000), "deeper than"),
    # 2^32 - 1 layers in a 2-layer file: the per-layer checks must not loop over the claim
    "block_count_2^32-1": (lambda d: _put(d, _after(d, b"llama.block_count") + 4, "<I", (1 << 32) - 1),
                           "block_count"),
    "kv_count_over_limit": (lambda d: _many_file(gguf_header.GGUF_MAX_KV + 1, 0), "key-value pairs"),
    "tensor_count_over_limit": (lambda d: _many_file(0, gguf_header.GGUF_MAX_TENSORS + 1), "tensors"),
    "array_element_type_77": (lambda d: _put(d, _after(d, b"hostile.arr") + 4, "<I", 77), "invalid element type 77"),
    "key_not_utf8": (lambda d: d.replace(b"hostile.str", b"hostile\xffstr", 1), "is not UTF-8"),
    "tensor_name_not_utf8": (lambda d: d.replace(_Q.encode(), b"blk.0.attn_\xff.weight", 1), "is not UTF-8"),
    "dim_zero": (_tensor(_Q, "dims", "<Q", lambda d, f: 0), "corrupt"),
    "nested_arrays_over_limit": (lambda d: _arrays_file(gguf_header.GGUF_MAX_NESTED_ARRAYS + 1), "arrays of arrays"),
}
#: cut lengths of the truncated-file variants (fractions of the file)
TRUNCATIONS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 0.99)


def _write_vocab_short(path: Path, n_tokens: int = 90) -> Path:
    def kv(w: GGUFWriter) -> None:
        toks = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n_tokens - 3)]
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_types([TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_NORMAL] * (n_tokens - 3))
        w.add_token_scores([0.0] * n_tokens)

    return write_tiny(path, n_vocab=100, extra_kv=kv)


def make_corpus(d: Path) -> dict[str, tuple[Path, str]]:
    """Write every hostile file into ``d``: name -> (path, fragment its error must contain)."""
    base = write_base(d / "base.gguf").read_bytes()
    out: dict[str, tuple[Path, str]] = {}
    for name, (edit, frag) in HOSTILE_FILES.items():
        p = d / f"{name}.gguf"
        p.write_bytes(edit(base))
        out[name] = (p, frag)
    for frac in TRUNCATIONS:
        p = d / f"truncated_{frac}.gguf"
        p.write_bytes(base[: int(len(base) * frac)])
        out[p.stem] = (p, "truncated")
    out["vocab_smaller_than_embedding"] = (_write_vocab_short(d / "vocab.gguf"), "fewer than the 100 rows")
    out["vocab_larger_than_embedding"] = (_write_vocab_short(d / "vocab2.gguf", 110), "more than the 100 rows")
    return out


# ---- hostile chat templates ----------------------------------------------------------------------

HOSTILE_TEMPLATES: dict[str, tuple[str, str]] = {
    "nested_huge_loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "nested_loops_over_list": (
        "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "string_times_4e9": ("{{ 'a' * 4000000000 }}", "repeated sequence"),
    "range_1e9": ("{{ range(10**9) }}", "range of more than"),
    "range_1e30": ("{% for i in range(10**30) %}{% endfor %}", "range of more than"),
    "macro_recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
    "macro_fan_out": (
        "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
        "longer than",
    ),
    "doubling_tilde": (
        "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "concatenation",
    ),
    "doubling_plus": (
        "{% set ns = namespace(s=['a']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "concatenation",
    ),
    "list_of_big_strings": ("{% set s = 'a' * 4000000 %}{{ [s] * 100000 }}", "repeated sequence"),
    "output_loop": ("{% set s = 'a' * 4000000 %}{% for i in range(1000) %}{{ s }}{% endfor %}", "output"),
    "macro_buffer": (
        "{% set s = 'a' * 4000000 %}{% macro f() %}{% for i in range(100000) %}{{ s ~ i }}{% endfor %}"
        "{% endmacro %}{{ f() }}",
        "output",
    ),
    "center_filter": ("{{ 'a'|center(4000000000) }}", "centered string"),
    "ljust_method": ("{{ 'a'.ljust(4000000000) }}", "str.ljust"),
    "format_width": ("{{ '{:>4000000000}'.format('a') }}", "str.format field"),
    "percent_width": ("{{ '%4000000000d' % 1 }}", "%-formatted"),
    "join_separator": ("{{ range(100000)|join('a' * 1000) }}", "joined string"),
    "replace_amplify": ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", "replaced string"),
    "indent_amplify": ("{{ ('\\n' * 10000)|indent(100000) }}", "indented string"),
    "batch_fill": ("{{ [1]|batch(1000000000, 'x')|list }}", "linecount"),
    "int_power": ("{{ 10 ** (10 ** 8) }}", "bits"),
    "int_squaring": (
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "bits",
    ),
    "division_by_zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "deep_source": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile"),
    "lipsum": ("{{ lipsum(10000000) }}", "undefined"),
}


def _render(template: str) -> str:
    return _tiny_tok(template).apply_chat_template([{"role": "user", "content": "hi"}])


# ---- measurements ------------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _refused(fn: Callable[[], Any]) -> tuple[ModelError, float, float]:
    """Run ``fn``; it must raise ModelError (nothing else). Returns the error, seconds, RSS growth (MB)."""
    r0, t0 = _rss_mb(), time.perf_counter()
    try:
        fn()
    except ModelError as e:
        err = e
    else:
        raise AssertionError("accepted")
    return err, time.perf_counter() - t0, _rss_mb() - r0


def corpus_report(d: str) -> None:
    """(Run in a child process.) Every hostile input, one at a time, with its time and the
    process's peak RSS growth over the baseline; prints one JSON object."""
    corpus = make_corpus(Path(d))
    _render("{{ 1 }}")  # import jinja2 and build the environment before the baseline
    load_model(write_base(Path(d) / "warm.gguf"))
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = []
    cases: list[tuple[str, Callable[[], Any]]] = [(f"file:{n}", lambda p=p: load_model(p)) for n, (p, _) in corpus.items()]
    cases += [(f"template:{n}", lambda t=t: _render(t)) for n, (t, _) in HOSTILE_TEMPLATES.items()]
    for name, fn in cases:
        t0 = time.perf_counter()
        try:
            fn()
            kind = "accepted"
        except ModelError:
            kind = "ModelError"
        except BaseException as e:  # noqa: BLE001 - reported, then failed by the test
            kind = type(e).__name__
        dt = time.perf_counter() - t0
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
        rows.append({"name": name, "kind": kind, "s": round(dt, 3), "peak_growth_mb": round(peak_mb, 1)})
    print(json.dumps(rows))


# ---- tests: the valid base file -------------------------------------------------------------------


def test_base_file_loads_with_its_metadata(tmp_path: Path) -> None:
    """The corpus's starting point is valid: a wrong edit helper would show up here first."""
    mf = load_model(write_base(tmp_path / "base.gguf"))
    assert mf.get("hostile.arr").tolist() == [1, 2, 3, 4] and mf.get("hostile.str") == "abcdefgh"
    h = gguf_header.preparse_header(tmp_path / "base.gguf", (tmp_path / "base.gguf").stat().st_size)
    assert h.kv_types["hostile.nested"] == (9, 9, 2) and mf.has("hostile.nested")  # depth 2: read
    assert mf.tensor(_Q).shape == (64, 64) and mf.tensor(_K).shape == (32, 64)
    data = (tmp_path / "base.gguf").read_bytes()
    # the layout helpers point at what the loader read
    f = _tensor_fields(data, _K)
    assert _u64(data, f["dims"]) == 64 and _u64(data, f["offset"]) + mf.data_offset == mf.tensor(_K).offset
    assert _u64(data, _after(data, b"hostile.arr") + 8) == 4
    assert struct.unpack_from("<IQ", data, _after(data, b"hostile.u8") + 4) == (0, 3)  # uint8 x 3


def test_edits_that_keep_the_file_valid_are_accepted(tmp_path: Path) -> None:
    """The checks are not over-eager: an edit that keeps the layout (a string's bytes) loads."""
    base = write_base(tmp_path / "base.gguf").read_bytes()
    p = tmp_path / "renamed.gguf"
    p.write_bytes(base.replace(b"abcdefgh", b"ABCDEFGH"))
    assert load_model(p).get("hostile.str") == "ABCDEFGH"


def test_preparse_agrees_with_gguf_reader_on_smol() -> None:
    from conftest import smol_path

    p = smol_path()
    h = gguf_header.preparse_header(p, p.stat().st_size)
    mf = load_model(p)
    assert h.data_offset == mf.data_offset and len(h.tensors) == len(mf.tensors) == 272
    for name, (_type, _ne, offset, nbytes) in h.tensors.items():
        assert (mf.tensors[name].offset, mf.tensors[name].nbytes) == (offset, nbytes)
    assert h.kv_types["tokenizer.ggml.tokens"] == (9, 8, 49152)


def test_synthetic_model_passes(tmp_path: Path) -> None:
    from vkxsplit.synth import write_synthetic

    mf = load_model(write_synthetic(tmp_path / "s.gguf", "tiny", "q4_0", n_vocab=512, n_layer=1))
    assert mf.hparams.n_vocab == 512 and mf.token_embd.rows == 512


# ---- tests: hostile files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    return make_corpus(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize(
    "name",
    [*HOSTILE_FILES, *(f"truncated_{f}" for f in TRUNCATIONS), "vocab_smaller_than_embedding",
     "vocab_larger_than_embedding"],
)
def test_hostile_file_is_refused(corpus: dict[str, tuple[Path, str]], name: str) -> None:
    path, frag = corpus[name]
    err, dt, grew = _refused(lambda: load_model(path))
    assert frag in str(err), str(err)
    assert str(path) in str(err) and err.hint
    assert dt < LIMIT_S and grew < LIMIT_MB, (dt, grew)


def test_every_prefix_of_the_header_is_refused(tmp_path: Path) -> None:
    base = write_base(tmp_path / "base.gguf").read_bytes()
    header_end = _tensor_fields(base, "blk.1.ffn_down.weight")["offset"] + 8
    p = tmp_path / "cut.gguf"
    for n in range(24, header_end, 7):
        p.write_bytes(base[:n])
        with pytest.raises(ModelError, match="truncated"):
            load_model(p)


def test_key_and_tensor_counts_at_the_limits_are_walked(tmp_path: Path) -> None:
    """The count limits are exact: a file at them is walked (its values read), one past is refused."""
    p = tmp_path / "many.gguf"
    for n_kv, n_t in ((gguf_header.GGUF_MAX_KV, 0), (0, gguf_header.GGUF_MAX_TENSORS)):
        p.write_bytes(_many_file(n_kv, n_t))
        h = gguf_header.preparse_header(p, p.stat().st_size)
        assert (len(h.values), len(h.tensors)) == (n_kv, n_t)
        assert h.values.get("k000001", 1) == 1 and h.tensors.get("t000001", (0,))[0] == 0
        p.write_bytes(_many_file(n_kv + (n_kv > 0), n_t + (n_t > 0)))
        with pytest.raises(ModelError, match="more than vkxsplit reads"):
            gguf_header.preparse_header(p, p.stat().st_size)


@pytest.mark.parametrize("bad", [0, 48, 1 << 31, "32"])
def test_bad_alignment_is_refused(tmp_path: Path, bad: int | str) -> None:
    """general.alignment must be a uint32 power of two (llama.cpp's check): 0 would divide by zero,
    48 misplace the data, a string is not read as 32."""
    def kv(w: GGUFWriter) -> None:
        (w.add_string if isinstance(bad, str) else w.add_uint32)("general.alignment", bad)  # type: ignore[operator]

    with pytest.raises(ModelError, match="value type" if isinstance(bad, str) else "not a power of two|truncated"):
        load_model(write_tiny(tmp_path / "a.gguf", extra_kv=kv))


def test_custom_alignment_is_followed(tmp_path: Path) -> None:
    """A valid alignment other than 32 places the data where gguf-py's writer put it."""
    from test_gguf_model import reader_differences

    p = write_tiny(tmp_path / "a.gguf", extra_kv=lambda w: w.add_custom_alignment(256))
    mf = load_model(p)
    assert mf.header.alignment == 256 and mf.data_offset % 256 == 0
    assert all((t.offset - mf.data_offset) % 256 == 0 for t in mf.tensors.values())
    assert reader_differences(p) == []


def test_nested_arrays_at_the_limit_are_read(tmp_path: Path) -> None:
    """The limit on arrays of arrays is exact: at it the file is walked and its value reads back."""
    p = tmp_path / "arrays.gguf"
    n = gguf_header.GGUF_MAX_NESTED_ARRAYS
    p.write_bytes(_arrays_file(n))
    h = gguf_header.preparse_header(p, p.stat().st_size)
    v, end = gguf_header.read_value(p.read_bytes(), h.value_pos["many"], 9)
    assert h.kv_types["many"] == (9, 9, n) and len(v) == n and end == p.stat().st_size
    assert all(a.dtype == np.uint8 and a.shape == (0,) for a in v[:3])


def test_preparse_trusts_no_size_beyond_the_file(tmp_path: Path) -> None:
    """A size larger than the file (say, a stat taken before the file was cut) does not let a
    truncated file pass: the walk bounds itself by the bytes it can read."""
    base = write_base(tmp_path / "base.gguf").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(base[:-100])  # tensor data cut short
    with pytest.raises(ModelError, match="truncated"):
        gguf_header.preparse_header(p, len(base))
    p.write_bytes(base[:200])  # header cut short: a ModelError, not a struct.error
    with pytest.raises(ModelError, match="truncated"):
        gguf_header.preparse_header(p, len(base))


@pytest.mark.parametrize("edit", ["string_array_count", "string_length", "u8_array_count", "nested_deeper"])
def test_value_rewritten_after_load_is_refused_within_its_bytes(tmp_path: Path, edit: str) -> None:
    """Arrays are decoded from the mapping when asked, after the walk: a file rewritten in place
    meanwhile (same size, as gguf-py's gguf_set_metadata edits) must not make the decode trust
    a new count or length: a count of 2^40 strings over the file's zero bytes would otherwise
    build a list of hundreds of millions of strings. A ModelError saying the file changed."""
    def kv(w: GGUFWriter) -> None:
        _base_kv(w)
        w.add_array("hostile.strs", ["ab", "cd"])

    p = write_tiny(tmp_path / "strs.gguf", extra_kv=kv)
    with open(p, "ab") as f:  # room for a runaway decode: 64 MB of zeros after the tensor data
        f.write(b"\0" * (64 << 20))
    mf = load_model(p)
    assert mf.get("hostile.strs") == ["ab", "cd"] and mf.get("hostile.u8").tolist() == [1, 2, 3]
    assert [a.tolist() for a in mf.get("hostile.nested")] == [[1, 2], [3]]
    data = p.read_bytes()
    at = {"string_array_count": (_after(data, b"hostile.strs") + 8, 1 << 40),
          "string_length": (_after(data, b"hostile.strs") + 16, 1 << 26),
          "u8_array_count": (_after(data, b"hostile.u8") + 8, 1 << 26),
          # [[1, 2], [3]] -> its first inner array's element type: array (of the next 12 bytes)
          "nested_deeper": (_after(data, b"hostile.nested") + 16, 9)}[edit]
    with open(p, "r+b") as f:
        f.seek(at[0])
        f.write(struct.pack("<I" if edit == "nested_deeper" else "<Q", at[1]))
    key = {"u8_array_count": "hostile.u8", "nested_deeper": "hostile.nested"}.get(edit, "hostile.strs")
    err, dt, grew = _refused(lambda: mf.get(key))
    assert "changed after it was loaded" in str(err) and key in str(err), str(err)
    assert dt < LIMIT_S and grew < LIMIT_MB, (dt, grew)


# ---- tests: hostile templates ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_template_is_refused(name: str) -> None:
    template, frag = HOSTILE_TEMPLATES[name]
    err, dt, grew = _refused(lambda: _render(template))
    assert frag in str(err), str(err)
    assert "--no-chat" in err.hint
    assert dt < LIMIT_S and grew < LIMIT_MB, (dt, grew)


def test_guarded_environment_renders_like_plain_jinja2() -> None:
    """The limits change nothing for real templates: SmolLM2's and ChatML, with a conversation."""
    from conftest import smol_path
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from vkxsplit.tokenizer import CHATML_TEMPLATE

    smol_tmpl = load_model(smol_path()).get("tokenizer.chat_template")
    tricky = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ loop.index }}/{{ loop.length }}{{ m.role|upper ~ ':' ~ m.content|trim }}{{ '%s!' % m.role }}"
        "{{ '{:>6}'.format(m.role) }}{{ ', '.join([m.role, m.content]) }}{{ m|tojson }}"
        "{% if not loop.last %}|{% endif %}{% endfor %}{{ ns.n * 2 }}{{ range(3)|join(',') }}"
        "{{ messages|map(attribute='role')|join(' ') }}{{ 2 ** 10 }}{{ [1, 2] + [3] }}{{ 'ab' * 3 }}"
    )
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi é "},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    plain.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
    for tmpl in (smol_tmpl, CHATML_TEMPLATE, tricky):
        for gen in (True, False):
            want = plain.from_string(tmpl).render(messages=msgs, add_generation_prompt=gen, bos_token="<s>",
                                                  eos_token="</s>", unk_token="<unk>", pad_token="")
            assert _tiny_tok(tmpl).apply_chat_template(msgs, add_generation_prompt=gen) == want


# ---- tests: a child process (peak memory) and the CLI --------------------------------------------------


def test_corpus_in_a_child_process_time_and_peak_memory(tmp_path: Path) -> None:
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_hostile; " \
           f"test_hostile.corpus_report({str(tmp_path)!r})"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == len(HOSTILE_FILES) + len(TRUNCATIONS) + 2 + len(HOSTILE_TEMPLATES)
    bad = [r for r in rows if r["kind"] != "ModelError" or r["s"] >= LIMIT_S or r["peak_growth_mb"] >= LIMIT_MB]
    print("\n".join(f"{r['name']:45s} {r['kind']:10s} {r['s']:6.3f} s  peak +{r['peak_growth_mb']} MB" for r in rows))
    assert not bad, bad


def _cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VKXSPLIT_TRACEBACK": ""}
    return subprocess.run([sys.executable, "-m", "vkxsplit", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("name", ["array_count_2^40", "offset_overlapping", "vocab_smaller_than_embedding"])
def test_cli_run_refuses_hostile_file(corpus: dict[str, tuple[Path, str]], name: str) -> None:
    path, frag = corpus[name]
    t0 = time.perf_counter()
    res = _cli(["run", "-m", str(path), "-p", "hi", "-n", "1"])
    assert time.perf_counter() - t0 < 60
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out, out
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("vkxsplit: error: ")]
    assert len(errors) == 1 and frag in errors[0] and str(path) in errors[0], res.stderr
    assert "\n  hint: " in res.stderr


def test_cli_run_refuses_hostile_template(tmp_path: Path) -> None:
    """A runnable synthetic model whose chat template loops forever: `run` stops with the cause."""
    from vkxsplit.synth import write_synthetic
    from vkxsplit.tokenizer import CHATML_TEMPLATE

    p = write_synthetic(tmp_path / "s.gguf", "tiny", "q4_0", n_vocab=512, n_layer=1)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    pad = len(CHATML_TEMPLATE) - len(loop) - len("{##}")
    hostile = loop + "{#" + "x" * pad + "#}"
    data = p.read_bytes()
    assert data.count(CHATML_TEMPLATE.encode()) == 1 and len(hostile) == len(CHATML_TEMPLATE)
    p.write_bytes(data.replace(CHATML_TEMPLATE.encode(), hostile.encode()))
    res = _cli(["run", "-m", str(p), "-p", "hi", "-n", "1"], timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out, out
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("vkxsplit: error: ")]
    assert len(errors) == 1 and "chat template ran more than" in errors[0], res.stderr
    assert "--no-chat" in res.stderr



# ---- sampling parameters (from the CLI or the API) -------------------------------------------


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=-0.1), dict(temperature="0.7"), dict(top_p=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5),
                                 dict(top_k=True), dict(top_k=float("nan"))])
def test_bad_sampling_parameters_are_refused(bad: dict[str, Any]) -> None:
    """NaN passed the old check (every comparison with NaN is false); each bad value is a
    VkxError naming the parameters, never a numpy error mid-generation."""
    from vkxsplit.errors import VkxError
    from vkxsplit.model import Sampler

    with pytest.raises(VkxError, match="bad sampling parameters"):
        Sampler(**bad)


def test_good_sampling_parameters_sample() -> None:
    import numpy as np

    from vkxsplit.model import Sampler

    logits = np.array([0.0, 5.0, 1.0, -2.0], np.float32)
    assert Sampler().sample(logits) == 1  # greedy
    s = Sampler(temperature=0.8, top_k=np.int64(2), top_p=1, seed=3)
    assert {s.sample(logits) for _ in range(50)} <= {1, 2}  # top-k 2 keeps ids 1 and 2


# ---- non-finite weights ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_weights_give_an_error_not_an_empty_answer(device, tmp_path: Path, temperature: float) -> None:
    """A NaN in the weights makes every logit NaN; the GPU argmax flags it (greedy) and the
    host checks the logits it samples from: a ModelError naming the cause, not the id 0 (an
    end token for many files, so an empty answer with exit 0) or a numpy error."""
    from gguf import GGUFReader

    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp_path / "nan.gguf", "smol135m", "q8_0", seed=5, n_vocab=500, n_layer=2)
    with load_model(path, device=device, n_ctx=32, ubatch=8) as m:  # finite: generates
        assert len(list(m.generate_ids([1, 2, 3], 2, temperature=temperature, seed=1, stop_ids=set()))) == 2
    t = next(t for t in GGUFReader(path).tensors if t.name == "output_norm.weight")
    with open(path, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(np.full(int(t.n_elements), np.nan, np.float32).tobytes())
    with load_model(path, device=device, n_ctx=32, ubatch=8) as m:
        with pytest.raises(ModelError, match="logits of nan.gguf are not finite"):
            list(m.generate_ids([1, 2, 3], 2, temperature=temperature, seed=1))
