// Weight-tile loader of mul_mat_coopmat.comp: eight consecutive elements k..k+7 (k % 8 == 0)
// of a GGUF row, split into a fetch (the raw bytes the eight elements need, read with the
// widest loads the block layout allows, into two uvec4) and a decode (raw -> 2 x vec4 of
// floats). The kernel issues the fetches of the next K slice before the matrix work on the
// current one and decodes afterwards, so the global loads are in flight during the MMAs.
//
// Include after dequant.glsl (it declares the weight buffers w_u8/w_u16/w_u32/w_u64/w_u128,
// WTYPE, QK, QBYTES, DQ_FLOAT). Only those declarations are used here; the helpers are
// private (prefix t8_) so the mat-vec side of dequant.glsl can change freely.
//
// Float types: t8_fetch needs k + 8 <= K and vector-aligned rows (F32: row % 16 bytes,
// F16/BF16: row % 8 bytes, i.e. K % 4 == 0); t8_fetch1 fetches element k + e alone (any row
// alignment) into the same raw layout, so one decode serves both.
#ifndef VKX_COOPMAT_DQ8_GLSL
#define VKX_COOPMAT_DQ8_GLSL

uint t8_h(uint byte_off) { return uint(w_u16[byte_off >> 1]); }                       // 2-aligned
uint t8_w2(uint byte_off) { return t8_h(byte_off) | (t8_h(byte_off + 2u) << 16); }    // 4 bytes, 2-aligned
float t8_half(uint bits) { return unpackHalf2x16(bits).x; }
vec4 t8_u8x4(uint q) { return vec4(uvec4(q, q >> 8, q >> 16, q >> 24) & 0xFFu); }
vec4 t8_i8x4(uint q) {
    int s = int(q);
    return vec4(bitfieldExtract(s, 0, 8), bitfieldExtract(s, 8, 8), bitfieldExtract(s, 16, 8),
                bitfieldExtract(s, 24, 8));
}
// bits 0..3 of h -> bit 4 of bytes 0..3 (fifth quant bit of Q5_0 / Q5_1)
uint t8_q5h(uint h) {
    return ((h & 1u) | ((h & 2u) << 7) | ((h & 4u) << 14) | ((h & 8u) << 21)) << 4;
}

#if DQ_FLOAT
// element k + e of a float row into raw slot e (rows of any alignment)
void t8_fetch1(uint rb, uint k, uint e, inout uvec4 r[2]) {
#if WTYPE == WT_F32
    r[e >> 2][e & 3u] = w_u32[(rb >> 2) + k + e];
#else
    // 16-bit element e goes to the low (e even) or high half of word e / 2
    const uint v = uint(w_u16[(rb >> 1) + k + e]);
    const uint wi = e >> 1;
    r[wi >> 2][wi & 3u] |= v << (16u * (e & 1u));
#endif
}
#endif

void t8_fetch(uint rb, uint k, out uvec4 r[2]) {
    r[0] = uvec4(0u);
    r[1] = uvec4(0u);
#if WTYPE == WT_F32
    r[0] = w_u128[(rb >> 4) + (k >> 2)];
    r[1] = w_u128[(rb >> 4) + (k >> 2) + 1u];
#elif WTYPE == WT_F16 || WTYPE == WT_BF16
    r[0] = uvec4(w_u64[(rb >> 3) + (k >> 2)], w_u64[(rb >> 3) + (k >> 2) + 1u]);
#elif WTYPE == WT_Q4_0
    const uint bb = rb + (k >> 5) * 18u;
    const uint j = k & 15u;
    r[0] = uvec4(t8_w2(bb + 2u + j), t8_w2(bb + 6u + j), t8_h(bb), 0u);
#elif WTYPE == WT_Q4_1
    const uint wb = (rb >> 2) + (k >> 5) * 5u;
    const uint j = (k & 15u) >> 2;
    r[0] = uvec4(w_u32[wb + 1u + j], w_u32[wb + 2u + j], w_u32[wb], 0u);
#elif WTYPE == WT_Q5_0
    const uint bb = rb + (k >> 5) * 22u;
    const uint j = k & 15u;
    r[0] = uvec4(t8_w2(bb + 6u + j), t8_w2(bb + 10u + j), t8_h(bb), t8_w2(bb + 2u));
#elif WTYPE == WT_Q5_1
    const uint wb = (rb >> 2) + (k >> 5) * 6u;
    const uint j = (k & 15u) >> 2;
    r[0] = uvec4(w_u32[wb + 2u + j], w_u32[wb + 3u + j], w_u32[wb], w_u32[wb + 1u]);
#elif WTYPE == WT_Q8_0
    const uint bb = rb + (k >> 5) * 34u;
    const uint i = k & 31u;
    r[0] = uvec4(t8_w2(bb + 2u + i), t8_w2(bb + 6u + i), t8_h(bb), 0u);
#elif WTYPE == WT_Q4_K
    // d, dmin | scales[12] | qs[128]: header in one 128-bit load, 8 qs bytes in one 64-bit
    const uint bb = rb + (k >> 8) * 144u;
    const uint i = k & 255u;
    r[0] = w_u128[bb >> 4];
    r[1] = uvec4(w_u64[(bb + 16u + 32u * (i >> 6) + (i & 31u)) >> 3], 0u, 0u);
#elif WTYPE == WT_Q5_K
    // d, dmin | scales[12] | qh[32] | qs[128]
    const uint bb = rb + (k >> 8) * 176u;
    const uint i = k & 255u;
    r[0] = w_u128[bb >> 4];
    r[1] = uvec4(w_u64[(bb + 48u + 32u * (i >> 6) + (i & 31u)) >> 3],
                 w_u64[(bb + 16u + (i & 31u)) >> 3]);
#elif WTYPE == WT_Q6_K
    // ql[128] | qh[64] | scales[16] (int8) | d (f16); element i = 128h + 32c + l
    const uint bb = rb + (k >> 8) * 210u;
    const uint i = k & 255u;
    const uint h = i >> 7;
    const uint c = (i >> 5) & 3u;
    const uint l = i & 31u;
    const uint qlb = bb + 64u * h + l + 32u * (c & 1u);
    const uint qhb = bb + 128u + 32u * h + l;
    r[0] = uvec4(t8_w2(qlb), t8_w2(qlb + 4u), t8_w2(qhb), t8_w2(qhb + 4u));
    r[1] = uvec4(t8_h(bb + 208u) | (uint(w_u8[bb + 192u + (i >> 4)]) << 16), 0u, 0u, 0u);
#elif WTYPE == WT_Q2_K
    // scales[16] | qs[64] | d, dmin; element i = 128h + 32j + l: bits 2j of qs[32h + l]. The
    // 8 qs bytes (4-aligned words), the (d, dmin) word and the scale byte i / 16
    const uint wb = (rb >> 2) + (k >> 8) * 21u;
    const uint i = k & 255u;
    const uint qw = wb + 4u + 8u * (i >> 7) + ((i & 31u) >> 2);
    r[0] = uvec4(w_u32[qw], w_u32[qw + 1u], w_u32[wb + 20u], (w_u32[wb + (i >> 6)] >> (8u * ((i >> 4) & 3u))) & 0xFFu);
#elif WTYPE == WT_Q3_K
    // hmask[32] | qs[64] | scales[12] | d; element i = 128h + 32j + l: bits 2j of qs[32h + l],
    // bit 4h + j of hmask[l]. The 8 qs and 8 hmask bytes, d and the two bytes of scale i / 16
    const uint bb = rb + (k >> 8) * 110u;
    const uint i = k & 255u;
    const uint l = i & 31u;
    const uint s = i >> 4;
    const uint qb = bb + 32u + 32u * (i >> 7) + l;
    r[0] = uvec4(t8_w2(qb), t8_w2(qb + 4u), t8_w2(bb + l), t8_w2(bb + l + 4u));
    r[1] = uvec4(t8_h(bb + 108u), uint(w_u8[bb + 96u + (s & 7u)]), uint(w_u8[bb + 104u + (s & 3u)]), 0u);
#elif WTYPE == WT_IQ4_NL
    const uint bb = rb + (k >> 5) * 18u;
    const uint j = k & 15u;
    r[0] = uvec4(t8_w2(bb + 2u + j), t8_w2(bb + 6u + j), t8_h(bb), 0u);
#elif WTYPE == WT_IQ4_XS
    // d | scales_h | scales_l[4] in one 64-bit load (136-byte blocks, 8-aligned), the 8 qs
    // bytes 16 s + (i & 8) of sub-block s = i / 32 in another (low or high nibbles by i & 16)
    const uint db = (rb >> 3) + (k >> 8) * 17u;
    const uint i = k & 255u;
    r[0] = uvec4(w_u64[db + 1u + 2u * (i >> 5) + ((i & 8u) >> 3)], w_u64[db]);
#endif
}

#if WTYPE == WT_IQ4_NL || WTYPE == WT_IQ4_XS
// ggml's kvalues_iq4nl, and the levels of the four nibbles in the low 4 bits of q's bytes
const float T8_KV_IQ4NL[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                        1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
vec4 t8_kv(uint q) {
    return vec4(T8_KV_IQ4NL[q & 15u], T8_KV_IQ4NL[(q >> 8) & 15u], T8_KV_IQ4NL[(q >> 16) & 15u],
                T8_KV_IQ4NL[(q >> 24) & 15u]);
}
#endif

#if WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
uint t8_kbyte(uvec4 hd, uint j) { return (hd[1u + (j >> 2)] >> (8u * (j & 3u))) & 0xFFu; }
// 6-bit scale and min of sub-block s from the block header (ggml's get_scale_min_k4)
void t8_scale_min(uvec4 hd, uint s, out float sc, out float mn) {
    if (s < 4u) {
        sc = float(t8_kbyte(hd, s) & 63u);
        mn = float(t8_kbyte(hd, s + 4u) & 63u);
    } else {
        const uint a = t8_kbyte(hd, s + 4u);
        sc = float((a & 0xFu) | ((t8_kbyte(hd, s - 4u) >> 6) << 4));
        mn = float((a >> 4) | ((t8_kbyte(hd, s) >> 6) << 4));
    }
}
#endif

// elements k..k+3 -> a, k+4..k+7 -> b
void t8_decode(uvec4 r[2], uint k, out vec4 a, out vec4 b) {
#if WTYPE == WT_F32
    a = uintBitsToFloat(r[0]);
    b = uintBitsToFloat(r[1]);
#elif WTYPE == WT_F16
    a = vec4(unpackHalf2x16(r[0].x), unpackHalf2x16(r[0].y));
    b = vec4(unpackHalf2x16(r[0].z), unpackHalf2x16(r[0].w));
#elif WTYPE == WT_BF16
    a = uintBitsToFloat(uvec4(r[0].x << 16, r[0].x & 0xFFFF0000u, r[0].y << 16, r[0].y & 0xFFFF0000u));
    b = uintBitsToFloat(uvec4(r[0].z << 16, r[0].z & 0xFFFF0000u, r[0].w << 16, r[0].w & 0xFFFF0000u));
#elif WTYPE == WT_Q4_0
    const uint sh = (k & 16u) >> 2;
    const float d = t8_half(r[0].z);
    a = (t8_u8x4((r[0].x >> sh) & 0x0F0F0F0Fu) - 8.0) * d;
    b = (t8_u8x4((r[0].y >> sh) & 0x0F0F0F0Fu) - 8.0) * d;
#elif WTYPE == WT_Q4_1
    const uint sh = (k & 16u) >> 2;
    const vec2 dm = unpackHalf2x16(r[0].z);
    a = t8_u8x4((r[0].x >> sh) & 0x0F0F0F0Fu) * dm.x + dm.y;
    b = t8_u8x4((r[0].y >> sh) & 0x0F0F0F0Fu) * dm.x + dm.y;
#elif WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1
    const uint i = k & 31u;
    const uint sh = (k & 16u) >> 2;
    const uint qa = ((r[0].x >> sh) & 0x0F0F0F0Fu) | t8_q5h(r[0].w >> i);
    const uint qb = ((r[0].y >> sh) & 0x0F0F0F0Fu) | t8_q5h(r[0].w >> (i + 4u));
#if WTYPE == WT_Q5_0
    const float d = t8_half(r[0].z);
    a = (t8_u8x4(qa) - 16.0) * d;
    b = (t8_u8x4(qb) - 16.0) * d;
#else
    const vec2 dm = unpackHalf2x16(r[0].z);
    a = t8_u8x4(qa) * dm.x + dm.y;
    b = t8_u8x4(qb) * dm.x + dm.y;
#endif
#elif WTYPE == WT_Q8_0
    const float d = t8_half(r[0].z);
    a = t8_i8x4(r[0].x) * d;
    b = t8_i8x4(r[0].y) * d;
#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
    const uint s = (k & 255u) >> 5;
    const vec2 dm = unpackHalf2x16(r[0].x);
    float sc, mn;
    t8_scale_min(r[0], s, sc, mn);
    const float scale = dm.x * sc;
    const float off = dm.y * mn;
    const uint sh = 4u * (s & 1u);
    uint qa = (r[1].x >> sh) & 0x0F0F0F0Fu;
    uint qb = (r[1].y >> sh) & 0x0F0F0F0Fu;
#if WTYPE == WT_Q5_K
    qa |= ((r[1].z >> s) & 0x01010101u) << 4;
    qb |= ((r[1].w >> s) & 0x01010101u) << 4;
#endif
    a = t8_u8x4(qa) * scale - off;
    b = t8_u8x4(qb) * scale - off;
#elif WTYPE == WT_Q6_K
    const uint c = (k >> 5) & 3u;
    const float d = t8_half(r[1].x & 0xFFFFu) * float(bitfieldExtract(int(r[1].x), 16, 8));
    const uint qa = ((r[0].x >> (4u * (c >> 1))) & 0x0F0F0F0Fu) | (((r[0].z >> (2u * c)) & 0x03030303u) << 4);
    const uint qb = ((r[0].y >> (4u * (c >> 1))) & 0x0F0F0F0Fu) | (((r[0].w >> (2u * c)) & 0x03030303u) << 4);
    a = (t8_u8x4(qa) - 32.0) * d;
    b = (t8_u8x4(qb) - 32.0) * d;
#elif WTYPE == WT_Q2_K
    const uint sh = 2u * ((k >> 5) & 3u);
    const vec2 dm = unpackHalf2x16(r[0].z);
    const float scale = dm.x * float(r[0].w & 15u);
    const float off = dm.y * float(r[0].w >> 4);
    a = t8_u8x4((r[0].x >> sh) & 0x03030303u) * scale - off;
    b = t8_u8x4((r[0].y >> sh) & 0x03030303u) * scale - off;
#elif WTYPE == WT_Q3_K
    const uint i = k & 255u;
    const uint j = (i >> 5) & 3u;
    const uint hs = 4u * (i >> 7) + j;
    const uint s = i >> 4;
    const uint sc6 = ((r[1].y >> (4u * (s >> 3))) & 15u) | (((r[1].z >> (2u * (s >> 2))) & 3u) << 4);
    const float d = t8_half(r[1].x) * float(int(sc6) - 32);
    const uint qa = ((r[0].x >> (2u * j)) & 0x03030303u) | (((r[0].z >> hs) & 0x01010101u) << 2);
    const uint qb = ((r[0].y >> (2u * j)) & 0x03030303u) | (((r[0].w >> hs) & 0x01010101u) << 2);
    a = (t8_u8x4(qa) - 4.0) * d;
    b = (t8_u8x4(qb) - 4.0) * d;
#elif WTYPE == WT_IQ4_NL
    const uint sh = (k & 16u) >> 2;
    const float d = t8_half(r[0].z);
    a = t8_kv((r[0].x >> sh) & 0x0F0F0F0Fu) * d;
    b = t8_kv((r[0].y >> sh) & 0x0F0F0F0Fu) * d;
#elif WTYPE == WT_IQ4_XS
    const uint s = (k & 255u) >> 5;
    const uint sh = (k & 16u) >> 2;
    const uint ls = ((r[0].w >> (4u * s)) & 15u) | (((r[0].z >> (16u + 2u * s)) & 3u) << 4);
    const float d = t8_half(r[0].z) * float(int(ls) - 32);
    a = t8_kv((r[0].x >> sh) & 0x0F0F0F0Fu) * d;
    b = t8_kv((r[0].y >> sh) & 0x0F0F0F0Fu) * d;
#endif
}

#endif
