// The body of a decode function of cm2_decode.glsl: element j (0..QK-1) of block B (a macro:
// the block's lvalue) of weight type WTYPE, as f16, following ggml's dequantize_row_* (the
// f32 products rounded to f16 once). Included inside a function body; not a shader by itself.
#if WTYPE == WT_F32
    return float16_t(B.v);
#elif WTYPE == WT_BF16
    return float16_t(uintBitsToFloat(uint(B.v) << 16));
#elif WTYPE == WT_Q4_0 || WTYPE == WT_Q4_1
    // byte j & 15 (halfword (j & 14) / 2, byte j & 1 of it), low nibble for j < 16; the index
    // masks bit 0 of j so elements 2i and 2i + 1 share the load
    const uint q = (uint(B.qs[(j & 14u) >> 1]) >> (8u * (j & 1u) + ((j & 16u) >> 2))) & 15u;
#if WTYPE == WT_Q4_0
    return float16_t(float(int(q) - 8) * float(B.d));
#else
    return float16_t(float(q) * float(B.d) + float(B.m));
#endif
#elif WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1
    const uint lo = (uint(B.qs[(j & 14u) >> 1]) >> (8u * (j & 1u) + ((j & 16u) >> 2))) & 15u;
#if WTYPE == WT_Q5_0
    const uint h = (uint(B.qh[j >> 4]) >> (j & 15u)) & 1u;  // bit j of the 32-bit qh
    return float16_t(float(int(lo | (h << 4)) - 16) * float(B.d));
#else
    const uint h = (B.qh >> j) & 1u;
    return float16_t(float(lo | (h << 4)) * float(B.d) + float(B.m));
#endif
#elif WTYPE == WT_Q8_0
    // the signed byte j of the halfword pair j / 2
    return float16_t(float(bitfieldExtract(int(uint(B.qs[j >> 1])), int(8u * (j & 1u)), 8)) * float(B.d));
#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
    // the header as one uvec4 (d, dmin; scale bytes 0-3, 4-7, 8-11) and ggml's
    // get_scale_min_k4(s) for all 8 sub-blocks at once, branch-free (as ggml-vulkan's
    // dequantFuncQ4_K): sub-blocks 0-3 take bytes 0-3 (scales) and 4-7 (mins) as they are,
    // 4-7 the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 / 4-7 above them
    const uvec4 h = B.h;
    const uint g = j >> 6, l = j & 63u;              // 64-element group, element in it
    const uint s = 2u * g + (l >> 5);                // sub-block
    const uint sc_hi = (h.w & 0x0F0F0F0Fu) | ((h.y & 0xC0C0C0C0u) >> 2);
    const uint mn_hi = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z & 0xC0C0C0C0u) >> 2);
    const uint sh = 8u * (s & 3u);
    const uint sc = ((s < 4u ? h.y : sc_hi) >> sh) & 63u;
    const uint mn = ((s < 4u ? h.z : mn_hi) >> sh) & 63u;
    // the nibbles' byte 32 g + (l & 31) (low or high nibble by l & 32) and Q5_K's high bits
    // (bit s of byte l & 31 of qh) as halfwords, bit 0 of j masked as in the types above
    uint q = (uint(B.qs[16u * g + ((l & 30u) >> 1)]) >> (8u * (j & 1u) + ((l & 32u) >> 3))) & 15u;
#if WTYPE == WT_Q5_K
    q |= ((uint(B.qh[(l & 30u) >> 1]) >> (8u * (j & 1u) + s)) & 1u) << 4;
#endif
    const vec2 dm = unpackHalf2x16(h.x);
    return float16_t(dm.x * float(sc) * float(q) - dm.y * float(mn));
#elif WTYPE == WT_Q6_K
    // ggml's layout per 128-element half h = j >> 7 (l = j & 31, quarter q = (j >> 5) & 3):
    // low 4 bits in byte 64 h + (j & 63) of ql (high nibble for q >= 2), high 2 bits at bit 2 q
    // of byte 32 h + l of qh, scale byte j >> 4. As halfwords (masking bit 0 of j, so
    // elements 2i and 2i + 1 share every load; ggml-vulkan's dequantFuncQ6_K):
    const uint ql = (uint(B.ql[((j & 0x80u) >> 2) + ((j & 0x3Eu) >> 1)]) >> (8u * (j & 1u) + ((j & 0x40u) >> 4))) & 15u;
    const uint qh = (uint(B.qh[((j & 0x80u) >> 3) + ((j & 0x1Eu) >> 1)]) >> (8u * (j & 1u) + ((j & 0x60u) >> 4))) & 3u;
    const int sc = int(B.scales[j >> 4]);
    return float16_t(float(B.d) * float(sc) * float(int(ql | (qh << 4)) - 32));
#elif WTYPE == WT_Q2_K || WTYPE == WT_Q3_K
    // element j = 128 h + 32 g + l: bits 2g of qs byte 32 h + l (halfword 16 h + l / 2, byte
    // l & 1 of it: bit 0 of j masked as above), sub-block scale j >> 4
    const uint l = j & 31u, g = (j >> 5) & 3u, h = j >> 7;
    uint q = (uint(B.qs[16u * h + (l >> 1)]) >> (8u * (j & 1u) + 2u * g)) & 3u;
    const uint s = j >> 4;
#if WTYPE == WT_Q2_K
    // scale byte: low nibble the scale, high nibble the min (ggml: d sc q - dmin m)
    const uint sm = uint(B.scales[s]);
    const vec2 dm = vec2(B.dm);
    return float16_t(dm.x * float(sm & 15u) * float(q) - dm.y * float(sm >> 4));
#else
    // third bit: bit 4h + g of hmask byte l (set: + 0, clear: - 4); the 6-bit scale: nibble
    // s / 8 of byte s % 8, bits 2 (s / 4) of byte 8 + s % 4 above it, minus 32
    q |= ((uint(B.hmask[l >> 1]) >> (8u * (j & 1u) + 4u * h + g)) & 1u) << 2;
    const uint lo = (uint(B.scales[s & 7u]) >> (4u * (s >> 3))) & 15u;
    const uint hi = (uint(B.scales[8u + (s & 3u)]) >> (2u * (s >> 2))) & 3u;
    return float16_t(float(B.d) * float(int(lo | (hi << 4)) - 32) * float(int(q) - 4));
#endif
#elif WTYPE == WT_IQ4_NL
    // Q4_0's nibble layout, the nibble indexing kvalues_iq4nl
    const uint q = (uint(B.qs[(j & 14u) >> 1]) >> (8u * (j & 1u) + ((j & 16u) >> 2))) & 15u;
    return float16_t(float(B.d) * KV_IQ4NL[q]);
#elif WTYPE == WT_IQ4_XS
    // sub-block s = j >> 5: IQ4_NL's nibble layout in qs bytes 16 s .. 16 s + 15, the 6-bit scale
    // nibble s & 1 of scales_l[s / 2] with bits 2s of scales_h above it, minus 32
    const uint s = j >> 5;
    const uint q = (uint(B.qs[8u * s + ((j & 14u) >> 1)]) >> (8u * (j & 1u) + ((j & 16u) >> 2))) & 15u;
    const uint ls = ((uint(B.scales_l[s >> 1]) >> (4u * (s & 1u))) & 15u) | (((uint(B.scales_h) >> (2u * s)) & 3u) << 4);
    return float16_t(float(B.d) * float(int(ls) - 32) * KV_IQ4NL[q]);
#endif
