// The body of a decode function of cm2_decode.glsl: element j (0..QK-1) of block B (a macro:
// the block's lvalue) of weight type WTYPE, as f16, following ggml's dequantize_row_* (the
// f32 products rounded to f16 once). Included inside a function body; not a shader by itself.
#if WTYPE == WT_F32
    return float16_t(B.v);
#elif WTYPE == WT_BF16
    return float16_t(uintBitsToFloat(uint(B.v) << 16));
#elif WTYPE == WT_Q4_0 || WTYPE == WT_Q4_1
    const uint q = (uint(B.qs[j & 15u]) >> ((j & 16u) >> 2)) & 15u;
#if WTYPE == WT_Q4_0
    return float16_t(float(int(q) - 8) * float(B.d));
#else
    return float16_t(float(q) * float(B.d) + float(B.m));
#endif
#elif WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1
    const uint lo = (uint(B.qs[j & 15u]) >> ((j & 16u) >> 2)) & 15u;
#if WTYPE == WT_Q5_0
    const uint h = (uint(B.qh[j >> 3]) >> (j & 7u)) & 1u;
    return float16_t(float(int(lo | (h << 4)) - 16) * float(B.d));
#else
    const uint h = (B.qh >> j) & 1u;
    return float16_t(float(lo | (h << 4)) * float(B.d) + float(B.m));
#endif
#elif WTYPE == WT_Q8_0
    return float16_t(float(int(B.qs[j])) * float(B.d));
#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
    const uint g = j >> 6, l = j & 63u;              // 64-element group, element in it
    const uint s = 2u * g + (l >> 5);                // sub-block: ggml's get_scale_min_k4(s)
    uint sc, mn;
    if (s < 4u) {
        sc = uint(B.scales[s]) & 63u;
        mn = uint(B.scales[s + 4u]) & 63u;
    } else {
        const uint hi = uint(B.scales[s + 4u]);
        sc = (hi & 15u) | ((uint(B.scales[s - 4u]) >> 6) << 4);
        mn = (hi >> 4) | ((uint(B.scales[s]) >> 6) << 4);
    }
    uint q = (uint(B.qs[32u * g + (l & 31u)]) >> ((l & 32u) >> 3)) & 15u;
#if WTYPE == WT_Q5_K
    q |= ((uint(B.qh[l & 31u]) >> s) & 1u) << 4;
#endif
    return float16_t(float(B.d) * float(sc) * float(q) - float(B.dmin) * float(mn));
#elif WTYPE == WT_Q6_K
    const uint half_ = j >> 7, quarter = (j >> 5) & 3u, l = j & 31u;
    const uint lo = (uint(B.ql[64u * half_ + l + 32u * (quarter & 1u)]) >> (4u * (quarter >> 1))) & 15u;
    const uint hb = (uint(B.qh[32u * half_ + l]) >> (2u * quarter)) & 3u;
    const int sc = int(B.scales[8u * half_ + (l >> 4) + 2u * quarter]);
    return float16_t(float(B.d) * float(sc) * float(int(lo | (hb << 4)) - 32));
#endif
