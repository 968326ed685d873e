// Dequantization of ggml weight rows, read byte-for-byte in the GGUF block layout.
//
// The including shader defines WTYPE (the ggml type enum value) and W_BINDING (the binding
// of the raw weight bytes) and enables GL_EXT_shader_16bit_storage and
// GL_EXT_shader_8bit_storage. The weight binding's byte offset is 16-byte aligned (the
// Python side checks); a row starts at row * ROW_BYTES(K) bytes and is, in general, only
// 2-byte aligned (Q4_0 is 18 bytes per block), so each type reads with the widest load its
// layout allows (8/16-bit for 2-aligned blocks, 32-bit for 4-aligned, 128-bit for the
// 16-aligned Q4_K/Q5_K; Q3_K's 110-byte blocks are 2-aligned, Q2_K's 84 4-aligned, IQ4_XS's 136
// 8-aligned).
//
// Two interfaces:
//   vec4 dq4(rb, k)   elements k..k+3 (k % 4 == 0) of the row whose first byte is rb;
//                     for float types the row must be vector-aligned (see DQ_VEC_ALIGN).
//   float dq1(rb, k)  one element (float types only: rows of any length and alignment).
//   dq_codes(rb, u, c, sc, mn) / dq_run(u, j)
//                     the mat-vec unit: DQ_U elements as DQ_NV runs of 4 (run j of unit u
//                     starts at element dq_run(u, j)) decoded to exact integer codes plus
//                     per-group scales and mins (see below). Each unit reads its bytes once
//                     with wide loads. Float types need K % DQ_U == 0 and 16-aligned rows.
#ifndef VKX_DEQUANT_GLSL
#define VKX_DEQUANT_GLSL

#include "ggml_types.glsl"

layout(std430, binding = W_BINDING) readonly buffer WBytes { uint8_t w_u8[]; };
layout(std430, binding = W_BINDING) readonly buffer WHalves { uint16_t w_u16[]; };
layout(std430, binding = W_BINDING) readonly buffer WWords { uint w_u32[]; };
layout(std430, binding = W_BINDING) readonly buffer WDWords { uvec2 w_u64[]; };
layout(std430, binding = W_BINDING) readonly buffer WQWords { uvec4 w_u128[]; };

uint ld8(uint b) { return uint(w_u8[b]); }
uint ld16(uint b) { return uint(w_u16[b >> 1]); }                 // b % 2 == 0
uint ld32(uint b) { return w_u32[b >> 2]; }                      // b % 4 == 0
uint ld16x2(uint b) { return ld16(b) | (ld16(b + 2u) << 16); }   // 4 bytes, b % 2 == 0
uvec2 ld64(uint b) { return w_u64[b >> 3]; }                     // b % 8 == 0
uvec4 ld128(uint b) { return w_u128[b >> 4]; }                   // b % 16 == 0

float h2f(uint bits) { return unpackHalf2x16(bits).x; }
// four bytes of a word as floats (unsigned)
vec4 u8x4(uint q) { return vec4(uvec4(q, q >> 8, q >> 16, q >> 24) & 0xFFu); }
// four bytes of a word as floats (signed, two's complement)
vec4 i8x4(uint q) {
    int s = int(q);
    return vec4(bitfieldExtract(s, 0, 8), bitfieldExtract(s, 8, 8), bitfieldExtract(s, 16, 8),
                bitfieldExtract(s, 24, 8));
}
// bits 0..3 of h -> bit 4 of bytes 0..3 (the fifth quant bit of Q5_0/Q5_1)
uint q5_high(uint h) {
    return ((h & 1u) | ((h & 2u) << 7) | ((h & 4u) << 14) | ((h & 8u) << 21)) << 4;
}
// K-quant 6-bit sub-block scale and min (ggml's get_scale_min_k4); s in 0..7, sc at byte scb
void scale_min_k4(uint scb, uint s, out float sc, out float mn) {
    if (s < 4u) {
        sc = float(ld8(scb + s) & 63u);
        mn = float(ld8(scb + s + 4u) & 63u);
    } else {
        uint a = ld8(scb + s + 4u);
        sc = float((a & 0xFu) | ((ld8(scb + s - 4u) >> 6) << 4));
        mn = float((a >> 4) | ((ld8(scb + s) >> 6) << 4));
    }
}
#if WTYPE == WT_IQ4_NL || WTYPE == WT_IQ4_XS
// ggml's kvalues_iq4nl: the 16 non-linear levels a 4-bit IQ4_NL / IQ4_XS code stands for
const float KV_IQ4NL[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                     1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
// the levels of the four nibbles in the low 4 bits of each byte of q (q & 0xF0F0F0F0 == 0)
vec4 kv_iq4(uint q) {
    return vec4(KV_IQ4NL[q & 15u], KV_IQ4NL[(q >> 8) & 15u], KV_IQ4NL[(q >> 16) & 15u], KV_IQ4NL[q >> 24]);
}
#endif
#if WTYPE == WT_Q3_K
// Q3_K's 6-bit sub-block scale s (0..15) from the 12 scale bytes at scb, minus 32 (ggml's
// dequantize_row_q3_K unpacking: low 4 bits are nibble s / 8 of byte s % 8, the high 2 bits
// are bits 2 (s / 4) of byte 8 + s % 4)
float q3k_scale(uint scb, uint s) {
    const uint lo = (ld8(scb + (s & 7u)) >> (4u * (s >> 3))) & 15u;
    const uint hi = (ld8(scb + 8u + (s & 3u)) >> (2u * (s >> 2))) & 3u;
    return float(int(lo | (hi << 4)) - 32);
}
#endif

#if WTYPE == WT_F32
#define QK 1u
#define QBYTES 4u
#define DQ_FLOAT 1
#define DQ_ESIZE 4u
#elif WTYPE == WT_F16
#define QK 1u
#define QBYTES 2u
#define DQ_FLOAT 1
#define DQ_ESIZE 2u
#elif WTYPE == WT_BF16
#define QK 1u
#define QBYTES 2u
#define DQ_FLOAT 1
#define DQ_ESIZE 2u
#elif WTYPE == WT_Q4_0
#define QK 32u
#define QBYTES 18u
#elif WTYPE == WT_Q4_1
#define QK 32u
#define QBYTES 20u
#elif WTYPE == WT_Q5_0
#define QK 32u
#define QBYTES 22u
#elif WTYPE == WT_Q5_1
#define QK 32u
#define QBYTES 24u
#elif WTYPE == WT_Q8_0
#define QK 32u
#define QBYTES 34u
#elif WTYPE == WT_Q4_K
#define QK 256u
#define QBYTES 144u
#elif WTYPE == WT_Q5_K
#define QK 256u
#define QBYTES 176u
#elif WTYPE == WT_Q6_K
#define QK 256u
#define QBYTES 210u
#elif WTYPE == WT_Q2_K
#define QK 256u
#define QBYTES 84u
#elif WTYPE == WT_Q3_K
#define QK 256u
#define QBYTES 110u
#elif WTYPE == WT_IQ4_NL
#define QK 32u
#define QBYTES 18u
#elif WTYPE == WT_IQ4_XS
#define QK 256u
#define QBYTES 136u
#else
#error "unknown WTYPE"
#endif

#ifndef DQ_FLOAT
#define DQ_FLOAT 0
#endif

// bytes of a row of K elements (K a multiple of QK)
#define ROW_BYTES(K) ((K) / QK * QBYTES)

// ------------------------------------------------------------------------------------------
// dq1: one element (float types)
#if DQ_FLOAT
float dq1(uint rb, uint k) {
#if WTYPE == WT_F32
    return uintBitsToFloat(ld32(rb + 4u * k));
#elif WTYPE == WT_F16
    return h2f(ld16(rb + 2u * k));
#else
    return uintBitsToFloat(ld16(rb + 2u * k) << 16);
#endif
}
#endif

// ------------------------------------------------------------------------------------------
// dq4: four consecutive elements k..k+3, k % 4 == 0
vec4 dq4(uint rb, uint k) {
#if WTYPE == WT_F32
    return uintBitsToFloat(ld128(rb + 4u * k));                 // row % 16 bytes == 0
#elif WTYPE == WT_F16
    uvec2 u = ld64(rb + 2u * k);                                // row % 8 bytes == 0
    return vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
#elif WTYPE == WT_BF16
    uvec2 u = ld64(rb + 2u * k);
    return uintBitsToFloat(uvec4(u.x << 16, u.x & 0xFFFF0000u, u.y << 16, u.y & 0xFFFF0000u));
#elif WTYPE == WT_Q4_0
    uint bb = rb + (k >> 5) * 18u;
    uint i = k & 31u;
    uint q = (ld16x2(bb + 2u + (i & 15u)) >> ((i & 16u) != 0u ? 4u : 0u)) & 0x0F0F0F0Fu;
    return (u8x4(q) - 8.0) * h2f(ld16(bb));
#elif WTYPE == WT_Q4_1
    uint bb = rb + (k >> 5) * 20u;
    uint i = k & 31u;
    vec2 dm = unpackHalf2x16(ld32(bb));
    uint q = (ld32(bb + 4u + (i & 15u)) >> ((i & 16u) != 0u ? 4u : 0u)) & 0x0F0F0F0Fu;
    return u8x4(q) * dm.x + dm.y;
#elif WTYPE == WT_Q5_0
    uint bb = rb + (k >> 5) * 22u;
    uint i = k & 31u;
    uint qh = ld16x2(bb + 2u);
    uint q = (ld16x2(bb + 6u + (i & 15u)) >> ((i & 16u) != 0u ? 4u : 0u)) & 0x0F0F0F0Fu;
    q |= q5_high(qh >> i);
    return (u8x4(q) - 16.0) * h2f(ld16(bb));
#elif WTYPE == WT_Q5_1
    uint bb = rb + (k >> 5) * 24u;
    uint i = k & 31u;
    vec2 dm = unpackHalf2x16(ld32(bb));
    uint qh = ld32(bb + 4u);
    uint q = (ld32(bb + 8u + (i & 15u)) >> ((i & 16u) != 0u ? 4u : 0u)) & 0x0F0F0F0Fu;
    q |= q5_high(qh >> i);
    return u8x4(q) * dm.x + dm.y;
#elif WTYPE == WT_Q8_0
    uint bb = rb + (k >> 5) * 34u;
    uint i = k & 31u;
    return i8x4(ld16x2(bb + 2u + i)) * h2f(ld16(bb));
#elif WTYPE == WT_Q4_K
    // d, dmin (f16) | scales[12] | qs[128]; sub-block s = i/32 uses qs[32*(s/2) + i%32],
    // low nibble for even s, high for odd
    uint bb = rb + (k >> 8) * 144u;
    uint i = k & 255u;
    uint s = i >> 5;
    vec2 dm = unpackHalf2x16(ld32(bb));
    float sc, mn;
    scale_min_k4(bb + 4u, s, sc, mn);
    uint q = (ld32(bb + 16u + 32u * (s >> 1) + (i & 31u)) >> (4u * (s & 1u))) & 0x0F0F0F0Fu;
    return u8x4(q) * (dm.x * sc) - dm.y * mn;
#elif WTYPE == WT_Q5_K
    // d, dmin | scales[12] | qh[32] | qs[128]; fifth bit of element i is bit s of qh[i%32]
    uint bb = rb + (k >> 8) * 176u;
    uint i = k & 255u;
    uint s = i >> 5;
    vec2 dm = unpackHalf2x16(ld32(bb));
    float sc, mn;
    scale_min_k4(bb + 4u, s, sc, mn);
    uint q = (ld32(bb + 48u + 32u * (s >> 1) + (i & 31u)) >> (4u * (s & 1u))) & 0x0F0F0F0Fu;
    q |= ((ld32(bb + 16u + (i & 31u)) >> s) & 0x01010101u) << 4;
    return u8x4(q) * (dm.x * sc) - dm.y * mn;
#elif WTYPE == WT_Q6_K
    // ql[128] | qh[64] | scales[16] (int8) | d (f16); element i = 128h + 32c + l:
    // low 4 bits: ql[64h + l + 32(c&1)] >> 4(c>>1), high 2: qh[32h + l] >> 2c, scale i/16
    uint bb = rb + (k >> 8) * 210u;
    uint i = k & 255u;
    uint h = i >> 7;
    uint c = (i >> 5) & 3u;
    uint l = i & 31u;
    uint ql = (ld16x2(bb + 64u * h + l + 32u * (c & 1u)) >> (4u * (c >> 1))) & 0x0F0F0F0Fu;
    uint qh = (ld16x2(bb + 128u + 32u * h + l) >> (2u * c)) & 0x03030303u;
    float sc = float(bitfieldExtract(int(ld8(bb + 192u + (i >> 4))), 0, 8));
    return (u8x4(ql | (qh << 4)) - 32.0) * (h2f(ld16(bb + 208u)) * sc);
#elif WTYPE == WT_Q2_K
    // scales[16] (low nibble scale, high nibble min) | qs[64] | d, dmin (f16); element
    // i = 128h + 32j + l: bits 2j of qs[32h + l], scale byte i/16
    uint bb = rb + (k >> 8) * 84u;
    uint i = k & 255u;
    uint q = (ld32(bb + 16u + 32u * (i >> 7) + (i & 31u)) >> (2u * ((i >> 5) & 3u))) & 0x03030303u;
    uint sm = ld8(bb + (i >> 4));
    vec2 dm = unpackHalf2x16(ld32(bb + 80u));
    return u8x4(q) * (dm.x * float(sm & 15u)) - dm.y * float(sm >> 4);
#elif WTYPE == WT_Q3_K
    // hmask[32] | qs[64] | scales[12] | d (f16); element i = 128h + 32j + l: low 2 bits at
    // bits 2j of qs[32h + l], third bit = bit 4h + j of hmask[l] (code - 4 where it is 0)
    uint bb = rb + (k >> 8) * 110u;
    uint i = k & 255u;
    uint h = i >> 7;
    uint j = (i >> 5) & 3u;
    uint l = i & 31u;
    uint q = (ld16x2(bb + 32u + 32u * h + l) >> (2u * j)) & 0x03030303u;
    q |= ((ld16x2(bb + l) >> (4u * h + j)) & 0x01010101u) << 2;
    return (u8x4(q) - 4.0) * (h2f(ld16(bb + 108u)) * q3k_scale(bb + 96u, i >> 4));
#elif WTYPE == WT_IQ4_NL
    // d (f16) | qs[16]: Q4_0's layout, the nibbles index kvalues_iq4nl
    uint bb = rb + (k >> 5) * 18u;
    uint i = k & 31u;
    uint q = (ld16x2(bb + 2u + (i & 15u)) >> ((i & 16u) != 0u ? 4u : 0u)) & 0x0F0F0F0Fu;
    return kv_iq4(q) * h2f(ld16(bb));
#elif WTYPE == WT_IQ4_XS
    // d (f16) | scales_h (u16) | scales_l[4] | qs[128]; sub-block s = i/32 has the 6-bit scale
    // (nibble s%2 of scales_l[s/2]) | (bits 2s of scales_h) << 4, minus 32, and IQ4_NL's
    // nibble layout in qs[16s .. 16s+15]
    uint bb = rb + (k >> 8) * 136u;
    uint i = k & 255u;
    uint s = i >> 5;
    uint q = (ld32(bb + 8u + 16u * s + (i & 15u)) >> ((i & 16u) != 0u ? 4u : 0u)) & 0x0F0F0F0Fu;
    uint ls = ((ld8(bb + 4u + (s >> 1)) >> (4u * (s & 1u))) & 15u) | (((ld16(bb + 2u) >> (2u * s)) & 3u) << 4);
    return kv_iq4(q) * (h2f(ld16(bb)) * float(int(ls) - 32));
#endif
}

// ------------------------------------------------------------------------------------------
// mat-vec units. A unit is DQ_U elements of a row as DQ_NV runs of 4 (run j starts at element
// dq_run(u, j)), in DQ_G scale groups of DQ_NV / DQ_G consecutive runs. dq_codes() reads the
// unit's bytes once (wide loads) and returns exact small-integer codes c[j] and per-group
// scale sc[g] and min mn[g]: element = sc[g] * code + mn[g] (DQ_MIN == 1), sc[g] * code (0).
// The mat-vec kernel factors the scales out of each group's dot product. Codes are made from
// bytes with the 2^23 trick (exact, no int -> float conversion instructions).

const float MAGIC = 8388608.0;  // 2^23: uintBitsToFloat(0x4B000000 | v) == 2^23 + v for v < 2^23
// the four bytes of q (each < 256) minus off, exactly
vec4 bytes_f(uint q, float off) {
    uvec4 b = (uvec4(q, q >> 8, q >> 16, q >> 24) & 0xFFu) | 0x4B000000u;
    return uintBitsToFloat(b) - (MAGIC + off);
}

#if DQ_FLOAT
#define DQ_U 8u
#define DQ_NV 2
#define DQ_G 1
#define DQ_MIN 0
uint dq_run(uint u, uint j) { return 8u * u + 4u * j; }
void dq_codes(uint rb, uint u, out vec4 c[DQ_NV], out float sc[DQ_G], out float mn[DQ_G]) {
    sc[0] = 1.0;
    mn[0] = 0.0;
#if WTYPE == WT_F32
    c[0] = uintBitsToFloat(w_u128[(rb >> 4) + 2u * u]);
    c[1] = uintBitsToFloat(w_u128[(rb >> 4) + 2u * u + 1u]);
#elif WTYPE == WT_F16
    uvec4 a = w_u128[(rb >> 4) + u];
    c[0] = vec4(unpackHalf2x16(a.x), unpackHalf2x16(a.y));
    c[1] = vec4(unpackHalf2x16(a.z), unpackHalf2x16(a.w));
#else
    uvec4 a = w_u128[(rb >> 4) + u];
    c[0] = uintBitsToFloat(uvec4(a.x << 16, a.x & 0xFFFF0000u, a.y << 16, a.y & 0xFFFF0000u));
    c[1] = uintBitsToFloat(uvec4(a.z << 16, a.z & 0xFFFF0000u, a.w << 16, a.w & 0xFFFF0000u));
#endif
}

#elif WTYPE == WT_Q4_0 || WTYPE == WT_Q4_1 || WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1 || WTYPE == WT_Q8_0 \
    || WTYPE == WT_IQ4_NL
// legacy quants (and IQ4_NL, Q4_0's layout with table codes): 4 lanes per block, lane t = u % 4 of block b = u / 4. Q4/Q5: qs bytes
// 4t..4t+3, i.e. elements 4t..4t+3 (low nibbles, run 0) and 16+4t..16+4t+3 (high nibbles,
// run 1); Q8_0: elements 8t..8t+7. The 4 lanes of a block read x in 64-byte pieces.
#define DQ_U 8u
#define DQ_NV 2
#define DQ_G 1
#if WTYPE == WT_Q4_1 || WTYPE == WT_Q5_1
#define DQ_MIN 1
#else
#define DQ_MIN 0
#endif
#if WTYPE == WT_Q8_0
uint dq_run(uint u, uint j) { return 32u * (u >> 2) + 8u * (u & 3u) + 4u * j; }
#else
uint dq_run(uint u, uint j) { return 32u * (u >> 2) + 4u * (u & 3u) + 16u * j; }
#endif
uint h16(uint i) { return uint(w_u16[i]); }
void dq_codes(uint rb, uint u, out vec4 c[DQ_NV], out float sc[DQ_G], out float mn[DQ_G]) {
    const uint t = u & 3u;
    mn[0] = 0.0;
#if WTYPE == WT_Q8_0
    const uint hb = (rb >> 1) + (u >> 2) * 17u;       // 16-bit index of the block
    sc[0] = h2f(h16(hb));
    const uint o = hb + 1u + 4u * t;
    c[0] = bytes_f((h16(o) | (h16(o + 1u) << 16)) ^ 0x80808080u, 128.0);
    c[1] = bytes_f((h16(o + 2u) | (h16(o + 3u) << 16)) ^ 0x80808080u, 128.0);
#else
#if WTYPE == WT_Q4_0 || WTYPE == WT_IQ4_NL
    const uint hb = (rb >> 1) + (u >> 2) * 9u;
    sc[0] = h2f(h16(hb));
    const uint q = h16(hb + 1u + 2u * t) | (h16(hb + 2u + 2u * t) << 16);
    const float off = 8.0;
#elif WTYPE == WT_Q5_0
    const uint hb = (rb >> 1) + (u >> 2) * 11u;
    sc[0] = h2f(h16(hb));
    const uint qh = (h16(hb + 1u) | (h16(hb + 2u) << 16)) >> (4u * t);
    const uint q = h16(hb + 3u + 2u * t) | (h16(hb + 4u + 2u * t) << 16);
    const float off = 16.0;
#elif WTYPE == WT_Q4_1
    const uint wb = (rb >> 2) + (u >> 2) * 5u;        // 32-bit index of the block
    const vec2 dm = unpackHalf2x16(w_u32[wb]);
    sc[0] = dm.x;
    mn[0] = dm.y;
    const uint q = w_u32[wb + 1u + t];
    const float off = 0.0;
#else  // Q5_1
    const uint wb = (rb >> 2) + (u >> 2) * 6u;
    const vec2 dm = unpackHalf2x16(w_u32[wb]);
    sc[0] = dm.x;
    mn[0] = dm.y;
    const uint qh = w_u32[wb + 1u] >> (4u * t);
    const uint q = w_u32[wb + 2u + t];
    const float off = 0.0;
#endif
    uint a = q & 0x0F0F0F0Fu;
    uint b = (q >> 4) & 0x0F0F0F0Fu;
#if WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1
    a |= q5_high(qh);
    b |= q5_high(qh >> 16);
#endif
#if WTYPE == WT_IQ4_NL
    c[0] = kv_iq4(a);
    c[1] = kv_iq4(b);
#else
    c[0] = bytes_f(a, off);
    c[1] = bytes_f(b, off);
#endif
#endif
}

#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
// a unit is lane t = u % 8 of block b = u / 8: run j (= sub-block j) is elements
// 32j + 4t .. +3, so the 8 lanes of a block read x coalesced (4t) for every j. Loads: the
// 16-byte header (d, dmin, 12 scale bytes), one qs word per sub-block pair (bytes 32p + 4t,
// low nibbles for sub-block 2p, high for 2p+1) and, for Q5_K, the qh word (bytes 4t: bit j
// of each byte is the fifth bit of sub-block j).
#define DQ_U 32u
#define DQ_NV 8
#define DQ_G 8
#define DQ_MIN 1
uint dq_run(uint u, uint j) { return 256u * (u >> 3) + 4u * (u & 7u) + 32u * j; }
// scale byte k (0..11) of a K-quant header
uint kscale_byte(uvec4 hd, uint k) { return (hd[1u + k / 4u] >> (8u * (k % 4u))) & 0xFFu; }
void dq_codes(uint rb, uint u, out vec4 c[DQ_NV], out float sc[DQ_G], out float mn[DQ_G]) {
    const uint qb = (rb >> 4) + (u >> 3) * (QBYTES / 16u);  // 128-bit index of the block
    const uint t = u & 7u;
    const uvec4 hd = w_u128[qb];
    const vec2 dm = unpackHalf2x16(hd.x);
#if WTYPE == WT_Q5_K
    const uint qh = w_u32[4u * qb + 4u + t];
    const uint qs0 = 4u * qb + 12u + t;
#else
    const uint qs0 = 4u * qb + 4u + t;
#endif
    [[unroll]] for (uint p = 0u; p < 4u; ++p) {
        const uint q = w_u32[qs0 + 8u * p];
        uint lo = q & 0x0F0F0F0Fu;
        uint hi = (q >> 4) & 0x0F0F0F0Fu;
#if WTYPE == WT_Q5_K
        lo |= ((qh >> (2u * p)) & 0x01010101u) << 4;
        hi |= ((qh >> (2u * p + 1u)) & 0x01010101u) << 4;
#endif
        c[2u * p] = bytes_f(lo, 0.0);
        c[2u * p + 1u] = bytes_f(hi, 0.0);
    }
    [[unroll]] for (uint j = 0u; j < 8u; ++j) {
        uint s6, m6;
        if (j < 4u) {
            s6 = kscale_byte(hd, j) & 63u;
            m6 = kscale_byte(hd, j + 4u) & 63u;
        } else {
            const uint a = kscale_byte(hd, j + 4u);
            s6 = (a & 0xFu) | ((kscale_byte(hd, j - 4u) >> 6) << 4);
            m6 = (a >> 4) | ((kscale_byte(hd, j) >> 6) << 4);
        }
        sc[j] = dm.x * (uintBitsToFloat(s6 | 0x4B000000u) - MAGIC);
        mn[j] = -(dm.y * (uintBitsToFloat(m6 | 0x4B000000u) - MAGIC));
    }
}

#elif WTYPE == WT_Q6_K
// a unit: t = u % 8, half h = t/4, l0 = 8 * (t % 4); group c = 0..3 holds runs 2c, 2c+1:
// elements 128h + 32c + l0 + 0..7, all with scale (128h + 32c + l0) / 16
#define DQ_U 32u
#define DQ_NV 8
#define DQ_G 4
#define DQ_MIN 0
uint dq_run(uint u, uint j) {
    uint t = u & 7u;
    return 256u * (u >> 3) + 128u * (t >> 2) + 32u * (j >> 1) + 8u * (t & 3u) + 4u * (j & 1u);
}
uint h16(uint i) { return uint(w_u16[i]); }
void dq_codes(uint rb, uint u, out vec4 c[DQ_NV], out float sc[DQ_G], out float mn[DQ_G]) {
    const uint hb = (rb >> 1) + (u >> 3) * 105u;   // 16-bit index of the block
    const uint t = u & 7u;
    const uint h = t >> 2;
    const uint l0 = 8u * (t & 3u);
    const uint qa = hb + 32u * h + (l0 >> 1);      // ql bytes 64h + l0 (groups 0, 2)
    const uint qb = qa + 16u;                      // ql bytes 64h + 32 + l0 (groups 1, 3)
    const uint qq = hb + 64u + 16u * h + (l0 >> 1); // qh bytes 32h + l0
    const uvec2 A = uvec2(h16(qa) | (h16(qa + 1u) << 16), h16(qa + 2u) | (h16(qa + 3u) << 16));
    const uvec2 B = uvec2(h16(qb) | (h16(qb + 1u) << 16), h16(qb + 2u) | (h16(qb + 3u) << 16));
    const uvec2 H = uvec2(h16(qq) | (h16(qq + 1u) << 16), h16(qq + 2u) | (h16(qq + 3u) << 16));
    const float d = h2f(h16(hb + 104u));
    const uint scb = 2u * hb + 192u + 8u * h + (l0 >> 4);
    [[unroll]] for (uint g = 0u; g < 4u; ++g) {
        sc[g] = d * float(bitfieldExtract(int(ld8(scb + 2u * g)), 0, 8));
        mn[g] = 0.0;
        const uvec2 ql = (((g & 1u) == 0u ? A : B) >> (4u * (g >> 1))) & 0x0F0F0F0Fu;
        const uvec2 q = ql | (((H >> (2u * g)) & 0x03030303u) << 4);
        c[2u * g] = bytes_f(q.x, 32.0);
        c[2u * g + 1u] = bytes_f(q.y, 32.0);
    }
}

#elif WTYPE == WT_Q2_K || WTYPE == WT_Q3_K
// Q6_K's unit: t = u % 8, half h = t/4, l0 = 8 * (t % 4); group g = 0..3 holds runs 2g, 2g+1:
// elements 128h + 32g + l0 + 0..7 (bits 2g of qs bytes 32h + l0 .. +7), all with sub-block
// scale (128h + 32g + l0) / 16 = 8h + 2g + l0/16. Q2_K: element = d sc q - dmin m (DQ_MIN);
// Q3_K: d (sc - 32) (q + 4 hbit - 4), hbit = bit 4h + g of hmask bytes l0 .. +7.
#define DQ_U 32u
#define DQ_NV 8
#define DQ_G 4
#if WTYPE == WT_Q2_K
#define DQ_MIN 1
#else
#define DQ_MIN 0
#endif
uint dq_run(uint u, uint j) {
    uint t = u & 7u;
    return 256u * (u >> 3) + 128u * (t >> 2) + 32u * (j >> 1) + 8u * (t & 3u) + 4u * (j & 1u);
}
uint h16(uint i) { return uint(w_u16[i]); }
void dq_codes(uint rb, uint u, out vec4 c[DQ_NV], out float sc[DQ_G], out float mn[DQ_G]) {
    const uint t = u & 7u;
    const uint h = t >> 2;
    const uint l0 = 8u * (t & 3u);
    const uint s0 = 8u * h + (l0 >> 4);               // scale index of group 0
#if WTYPE == WT_Q2_K
    const uint wb = (rb >> 2) + (u >> 3) * 21u;       // 32-bit index of the block
    const uvec2 Q = uvec2(w_u32[wb + 4u + 8u * h + (l0 >> 2)], w_u32[wb + 5u + 8u * h + (l0 >> 2)]);
    const vec2 dm = unpackHalf2x16(w_u32[wb + 20u]);
    [[unroll]] for (uint g = 0u; g < 4u; ++g) {
        const uint sm = (w_u32[wb + ((s0 + 2u * g) >> 2)] >> (8u * ((s0 + 2u * g) & 3u))) & 0xFFu;
        sc[g] = dm.x * float(sm & 15u);
        mn[g] = -(dm.y * float(sm >> 4));
        const uvec2 q = (Q >> (2u * g)) & 0x03030303u;
        c[2u * g] = bytes_f(q.x, 0.0);
        c[2u * g + 1u] = bytes_f(q.y, 0.0);
    }
#else
    const uint hb = (rb >> 1) + (u >> 3) * 55u;       // 16-bit index of the block
    const uint qa = hb + 16u + 16u * h + (l0 >> 1);   // qs bytes 32h + l0
    const uint ma = hb + (l0 >> 1);                   // hmask bytes l0
    const uvec2 Q = uvec2(h16(qa) | (h16(qa + 1u) << 16), h16(qa + 2u) | (h16(qa + 3u) << 16));
    const uvec2 H = uvec2(h16(ma) | (h16(ma + 1u) << 16), h16(ma + 2u) | (h16(ma + 3u) << 16));
    const float d = h2f(h16(hb + 54u));
    [[unroll]] for (uint g = 0u; g < 4u; ++g) {
        sc[g] = d * q3k_scale(2u * hb + 96u, s0 + 2u * g);
        mn[g] = 0.0;
        const uvec2 q = ((Q >> (2u * g)) & 0x03030303u) | (((H >> (4u * h + g)) & 0x01010101u) << 2);
        c[2u * g] = bytes_f(q.x, 4.0);
        c[2u * g + 1u] = bytes_f(q.y, 4.0);
    }
#endif
}

#elif WTYPE == WT_IQ4_XS
// a unit is lane t = u % 8 of block b = u / 8: qs words t + 8p (p = 0..3) of the block, i.e.
// bytes 16s + 4(t%4) .. +3 of sub-block s = 2p + t/4: run 2p (low nibbles) is elements
// 32s + 4(t%4) + 0..3, run 2p+1 (high nibbles) the same + 16; group p has sub-block s's scale.
// The 8 lanes of a block read 32 consecutive qs bytes per p. Codes are kvalues_iq4nl levels.
#define DQ_U 32u
#define DQ_NV 8
#define DQ_G 4
#define DQ_MIN 0
uint dq_run(uint u, uint j) {
    uint t = u & 7u;
    return 256u * (u >> 3) + 32u * (2u * (j >> 1) + (t >> 2)) + 16u * (j & 1u) + 4u * (t & 3u);
}
void dq_codes(uint rb, uint u, out vec4 c[DQ_NV], out float sc[DQ_G], out float mn[DQ_G]) {
    const uint t = u & 7u;
    const uint db = (rb >> 3) + (u >> 3) * 17u;      // 64-bit index of the block
    const uvec2 hd = w_u64[db];                       // d | scales_h, scales_l[4]
    const float d = unpackHalf2x16(hd.x).x;
    const uint sh = hd.x >> 16;
    [[unroll]] for (uint p = 0u; p < 4u; ++p) {
        const uint s = 2u * p + (t >> 2);
        const uint q = w_u32[2u * db + 2u + t + 8u * p];
        c[2u * p] = kv_iq4(q & 0x0F0F0F0Fu);
        c[2u * p + 1u] = kv_iq4((q >> 4) & 0x0F0F0F0Fu);
        const uint ls = ((hd.y >> (8u * p + 4u * (t >> 2))) & 15u) | (((sh >> (2u * s)) & 3u) << 4);
        sc[p] = d * float(int(ls) - 32);
        mn[p] = 0.0;
    }
}
#endif


// ------------------------------------------------------------------------------------------
// mat-vec units, second generation (dqx_*): the same contract as dq_codes() / dq_run()
// (DQX_U elements as DQX_NV runs of 4 in DQX_G scale groups, exact codes, per-group scale
// and min) with a tunable number of lanes per block, DQX_L, so a lane can read more bytes
// per unit, and cheaper scale decoding for the K-quants. Used by mul_mat_vec.comp only.
//   Q4_0, Q4_1, Q8_0: DQX_L = 4 (default) or 2 lanes per 32-element block;
//   Q4_K, Q5_K:       DQX_L = 8 (default) or 4 lanes per 256-element superblock;
//   other types:      the dq_codes() units (DQX_L ignored).
const float DQX_MAGIC = 8388608.0;
// the four bytes of q as floats 2^23 + byte (exact; subtract DQX_MAGIC for the byte)
vec4 bytes_magic(uint q) {
    return uintBitsToFloat((uvec4(q, q >> 8, q >> 16, q >> 24) & 0xFFu) | 0x4B000000u);
}

#if WTYPE == WT_Q4_0 || WTYPE == WT_Q4_1 || WTYPE == WT_Q8_0
#ifndef DQX_L
#define DQX_L 4
#endif
#if DQX_L != 2 && DQX_L != 4
#error "DQX_L must be 2 or 4 for the legacy quants"
#endif
#define DQX_U (32u / DQX_L)
#if WTYPE == WT_Q8_0
// lane t: qs bytes [BPL t, BPL t + BPL) = elements of the same indices, W = BPL / 4 words
#define DQX_W (8 / DQX_L)
#define DQX_NV DQX_W
#else
// lane t: qs bytes [BPL t, +BPL) (BPL = 16 / DQX_L): low nibbles are elements BPL t + i,
// high nibbles 16 + BPL t + i; runs 0..W-1 low, W..2W-1 high
#define DQX_W (4 / DQX_L)
#define DQX_NV (2 * DQX_W)
#endif
#define DQX_G 1
#if WTYPE == WT_Q4_1
#define DQX_MIN 1
#else
#define DQX_MIN 0
#endif
uint dqx_run(uint u, uint j) {
    const uint b = u / uint(DQX_L);
    const uint t = u % uint(DQX_L);
#if WTYPE == WT_Q8_0
    return 32u * b + 4u * (uint(DQX_W) * t + j);
#else
    const uint w = j % uint(DQX_W);
    const uint hi = j / uint(DQX_W);
    return 32u * b + 16u * hi + 4u * (uint(DQX_W) * t + w);
#endif
}
void dqx_codes(uint rb, uint u, out vec4 c[DQX_NV], out float sc[DQX_G], out float mn[DQX_G]) {
    const uint b = u / uint(DQX_L);
    const uint t = u % uint(DQX_L);
    mn[0] = 0.0;
#if WTYPE == WT_Q8_0
    const uint hb = (rb >> 1) + b * 17u;                 // 16-bit index of the block
    sc[0] = h2f(uint(w_u16[hb]));
    const uint o = hb + 1u + 2u * uint(DQX_W) * t;
    [[unroll]] for (uint j = 0u; j < uint(DQX_W); ++j) {
        const uint q = uint(w_u16[o + 2u * j]) | (uint(w_u16[o + 2u * j + 1u]) << 16);
        c[j] = bytes_f(q ^ 0x80808080u, 128.0);
    }
#else
#if WTYPE == WT_Q4_0
    const uint hb = (rb >> 1) + b * 9u;
    sc[0] = h2f(uint(w_u16[hb]));
    const uint o = hb + 1u + 2u * uint(DQX_W) * t;
    const float off = 8.0;
#else  // Q4_1: 20-byte blocks, 4-byte aligned
    const uint wb = (rb >> 2) + b * 5u;                  // 32-bit index of the block
    const vec2 dm = unpackHalf2x16(w_u32[wb]);
    sc[0] = dm.x;
    mn[0] = dm.y;
    const uint o = wb + 1u + uint(DQX_W) * t;
    const float off = 0.0;
#endif
    [[unroll]] for (uint j = 0u; j < uint(DQX_W); ++j) {
#if WTYPE == WT_Q4_0
        const uint q = uint(w_u16[o + 2u * j]) | (uint(w_u16[o + 2u * j + 1u]) << 16);
#else
        const uint q = w_u32[o + j];
#endif
        c[j] = bytes_f(q & 0x0F0F0F0Fu, off);
        c[j + uint(DQX_W)] = bytes_f((q >> 4) & 0x0F0F0F0Fu, off);
    }
#endif
}

#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
#ifndef DQX_L
#define DQX_L 8
#endif
#if DQX_L != 4 && DQX_L != 8
#error "DQX_L must be 4 or 8 for Q4_K / Q5_K"
#endif
// lane t of DQX_L per superblock: words [W t, W t + W) (W = 8 / DQX_L) of each 32-byte qs
// row p (p = 0..3): low nibbles are sub-block 2p, high nibbles 2p + 1. Run j = W g + w of
// group (sub-block) g is elements 32 g + 4 (W t + w).
#define DQX_W (8 / DQX_L)
#define DQX_U (256u / DQX_L)
#define DQX_NV (8 * DQX_W)
#define DQX_G 8
#define DQX_MIN 1
uint dqx_run(uint u, uint j) {
    const uint t = u % uint(DQX_L);
    return 256u * (u / uint(DQX_L)) + 32u * (j / uint(DQX_W)) + 4u * (uint(DQX_W) * t + j % uint(DQX_W));
}
void dqx_codes(uint rb, uint u, out vec4 c[DQX_NV], out float sc[DQX_G], out float mn[DQX_G]) {
    const uint qb = (rb >> 4) + (u / uint(DQX_L)) * (QBYTES / 16u);  // 128-bit index of the block
    const uint t = u % uint(DQX_L);
    const uvec4 hd = w_u128[qb];
    const vec2 dm = unpackHalf2x16(hd.x);
#if WTYPE == WT_Q5_K
    const uint qh0 = 4u * qb + 4u + uint(DQX_W) * t;
    const uint qs0 = 4u * qb + 12u + uint(DQX_W) * t;
#else
    const uint qs0 = 4u * qb + 4u + uint(DQX_W) * t;
#endif
    [[unroll]] for (uint w = 0u; w < uint(DQX_W); ++w) {
#if WTYPE == WT_Q5_K
        const uint qh = w_u32[qh0 + w];
#endif
        [[unroll]] for (uint p = 0u; p < 4u; ++p) {
            const uint q = w_u32[qs0 + 8u * p + w];
            uint lo = q & 0x0F0F0F0Fu;
            uint hi = (q >> 4) & 0x0F0F0F0Fu;
#if WTYPE == WT_Q5_K
            lo |= ((qh >> (2u * p)) & 0x01010101u) << 4;
            hi |= ((qh >> (2u * p + 1u)) & 0x01010101u) << 4;
#endif
            c[uint(DQX_W) * (2u * p) + w] = bytes_f(lo, 0.0);
            c[uint(DQX_W) * (2u * p + 1u) + w] = bytes_f(hi, 0.0);
        }
    }
    // the sixteen 6-bit scales and mins, four per word (bytes 0..3: sub-blocks 0..3 / 4..7)
    const uint s_lo = hd.y & 0x3F3F3F3Fu;
    const uint m_lo = hd.z & 0x3F3F3F3Fu;
    const uint s_hi = (hd.w & 0x0F0F0F0Fu) | ((hd.y >> 2) & 0x30303030u);
    const uint m_hi = ((hd.w >> 4) & 0x0F0F0F0Fu) | ((hd.z >> 2) & 0x30303030u);
    // exact small integers (2^23 + s - 2^23), then one rounding in the product with d / -dmin
    // (not fma(d, 2^23 + s, -d 2^23): drivers may split an fma even when marked precise)
    const vec4 sl = (bytes_magic(s_lo) - DQX_MAGIC) * dm.x;
    const vec4 sh = (bytes_magic(s_hi) - DQX_MAGIC) * dm.x;
    const vec4 ml = (bytes_magic(m_lo) - DQX_MAGIC) * -dm.y;
    const vec4 mh = (bytes_magic(m_hi) - DQX_MAGIC) * -dm.y;
    [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        sc[j] = sl[j];
        sc[j + 4u] = sh[j];
        mn[j] = ml[j];
        mn[j + 4u] = mh[j];
    }
}

#else
// every other type: the dq_codes() units
#define DQX_U DQ_U
#define DQX_NV DQ_NV
#define DQX_G DQ_G
#define DQX_MIN DQ_MIN
uint dqx_run(uint u, uint j) { return dq_run(u, j); }
void dqx_codes(uint rb, uint u, out vec4 c[DQX_NV], out float sc[DQX_G], out float mn[DQX_G]) {
    dq_codes(rb, u, c, sc, mn);
}
#endif

#endif
