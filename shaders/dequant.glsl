// Dequantization of ggml weight rows, read byte-for-byte in the GGUF block layout.
//
// The including shader defines WTYPE (the ggml type enum value) and W_BINDING (the binding
// of the raw weight bytes) and enables GL_EXT_shader_16bit_storage and
// GL_EXT_shader_8bit_storage. The weight binding's byte offset is 16-byte aligned (the
// Python side checks); a row starts at row * ROW_BYTES(K) bytes and is, in general, only
// 2-byte aligned (Q4_0 is 18 bytes per block), so each type reads with the widest load its
// layout allows (8/16-bit for 2-aligned blocks, 32-bit for 4-aligned, 128-bit for the
// 16-aligned Q4_K/Q5_K).
//
// Two interfaces:
//   vec4 dq4(rb, k)   elements k..k+3 (k % 4 == 0) of the row whose first byte is rb;
//                     for float types the row must be vector-aligned (see DQ_VEC_ALIGN).
//   float dq1(rb, k)  one element (float types only: rows of any length and alignment).
//   dq_unit(rb, u, v) / dq_run(u, j)
//                     the mat-vec unit: DQ_U elements as DQ_NV runs of 4; run j of unit u
//                     starts at element dq_run(u, j) of the row. Each unit reads its bytes
//                     once with wide loads. Float types need K % DQ_U == 0 and aligned rows.
#ifndef VKX_DEQUANT_GLSL
#define VKX_DEQUANT_GLSL

#define WT_F32 0
#define WT_F16 1
#define WT_Q4_0 2
#define WT_Q4_1 3
#define WT_Q5_0 6
#define WT_Q5_1 7
#define WT_Q8_0 8
#define WT_Q4_K 12
#define WT_Q5_K 13
#define WT_Q6_K 14
#define WT_BF16 30

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
#endif
}

// ------------------------------------------------------------------------------------------
// mat-vec units
#if DQ_FLOAT
#define DQ_U 8u
#define DQ_NV 2
uint dq_run(uint u, uint j) { return 8u * u + 4u * j; }
void dq_unit(uint rb, uint u, out vec4 v[DQ_NV]) {
#if WTYPE == WT_F32
    v[0] = uintBitsToFloat(ld128(rb + 32u * u));
    v[1] = uintBitsToFloat(ld128(rb + 32u * u + 16u));
#elif WTYPE == WT_F16
    uvec4 a = ld128(rb + 16u * u);
    v[0] = vec4(unpackHalf2x16(a.x), unpackHalf2x16(a.y));
    v[1] = vec4(unpackHalf2x16(a.z), unpackHalf2x16(a.w));
#else
    uvec4 a = ld128(rb + 16u * u);
    v[0] = uintBitsToFloat(uvec4(a.x << 16, a.x & 0xFFFF0000u, a.y << 16, a.y & 0xFFFF0000u));
    v[1] = uintBitsToFloat(uvec4(a.z << 16, a.z & 0xFFFF0000u, a.w << 16, a.w & 0xFFFF0000u));
#endif
}

#elif WTYPE == WT_Q4_0 || WTYPE == WT_Q4_1 || WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1 || WTYPE == WT_Q8_0
// legacy quants: a unit is half a block, qs bytes 8h..8h+7 (h = u % 2), i.e. elements
// 8h..8h+7 (low nibbles / first bytes) and 16+8h..16+8h+7 (high nibbles)
#define DQ_U 16u
#define DQ_NV 4
#if WTYPE == WT_Q8_0
uint dq_run(uint u, uint j) { return 16u * u + 4u * j; }
#else
uint dq_run(uint u, uint j) { return 32u * (u >> 1) + 8u * (u & 1u) + 4u * (j & 1u) + 16u * (j >> 1); }
#endif
void dq_unit(uint rb, uint u, out vec4 v[DQ_NV]) {
    uint bb = rb + (u >> 1) * QBYTES;
    uint hh = u & 1u;
#if WTYPE == WT_Q8_0
    float d = h2f(ld16(bb));
    uint o = bb + 2u + 16u * hh;
    v[0] = i8x4(ld16x2(o)) * d;
    v[1] = i8x4(ld16x2(o + 4u)) * d;
    v[2] = i8x4(ld16x2(o + 8u)) * d;
    v[3] = i8x4(ld16x2(o + 12u)) * d;
#else
#if WTYPE == WT_Q4_0
    float d = h2f(ld16(bb));
    float m = -8.0 * d;
    uint q0 = ld16x2(bb + 2u + 8u * hh);
    uint q1 = ld16x2(bb + 6u + 8u * hh);
#elif WTYPE == WT_Q4_1
    vec2 dm = unpackHalf2x16(ld32(bb));
    float d = dm.x, m = dm.y;
    uint q0 = ld32(bb + 4u + 8u * hh);
    uint q1 = ld32(bb + 8u + 8u * hh);
#elif WTYPE == WT_Q5_0
    float d = h2f(ld16(bb));
    float m = -16.0 * d;
    uint qh = ld16x2(bb + 2u) >> (8u * hh);
    uint q0 = ld16x2(bb + 6u + 8u * hh);
    uint q1 = ld16x2(bb + 10u + 8u * hh);
#elif WTYPE == WT_Q5_1
    vec2 dm = unpackHalf2x16(ld32(bb));
    float d = dm.x, m = dm.y;
    uint qh = ld32(bb + 4u) >> (8u * hh);
    uint q0 = ld32(bb + 8u + 8u * hh);
    uint q1 = ld32(bb + 12u + 8u * hh);
#endif
    uint a0 = q0 & 0x0F0F0F0Fu, a1 = q1 & 0x0F0F0F0Fu;
    uint b0 = (q0 >> 4) & 0x0F0F0F0Fu, b1 = (q1 >> 4) & 0x0F0F0F0Fu;
#if WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1
    a0 |= q5_high(qh);
    a1 |= q5_high(qh >> 4);
    b0 |= q5_high(qh >> 16);
    b1 |= q5_high(qh >> 20);
#endif
    // q * d + m: for Q4_0/Q5_0 m = -offset * d, i.e. (q - offset) * d up to one rounding
    v[0] = fma(u8x4(a0), vec4(d), vec4(m));
    v[1] = fma(u8x4(a1), vec4(d), vec4(m));
    v[2] = fma(u8x4(b0), vec4(d), vec4(m));
    v[3] = fma(u8x4(b1), vec4(d), vec4(m));
#endif
}

#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
// a unit is 16 qs bytes: t = u % 8, pair p = t/2, half hh = t%2; elements
// 64p + 16hh + 0..15 (low nibbles, sub-block 2p) and 64p + 32 + 16hh + 0..15 (high, 2p+1)
#define DQ_U 32u
#define DQ_NV 8
uint dq_run(uint u, uint j) {
    uint t = u & 7u;
    return 256u * (u >> 3) + 64u * (t >> 1) + 16u * (t & 1u) + 4u * (j & 3u) + 32u * (j >> 2);
}
void dq_unit(uint rb, uint u, out vec4 v[DQ_NV]) {
    uint bb = rb + (u >> 3) * QBYTES;
    uint t = u & 7u;
    uint p = t >> 1;
    uint hh = t & 1u;
    vec2 dm = unpackHalf2x16(ld32(bb));
    float sc0, mn0, sc1, mn1;
    scale_min_k4(bb + 4u, 2u * p, sc0, mn0);
    scale_min_k4(bb + 4u, 2u * p + 1u, sc1, mn1);
    float d0 = dm.x * sc0, m0 = dm.y * mn0;
    float d1 = dm.x * sc1, m1 = dm.y * mn1;
#if WTYPE == WT_Q4_K
    uvec4 q = ld128(bb + 16u + 32u * p + 16u * hh);
    uvec4 lo = q & 0x0F0F0F0Fu;
    uvec4 hi = (q >> 4) & 0x0F0F0F0Fu;
#else
    uvec4 q = ld128(bb + 48u + 32u * p + 16u * hh);
    uvec4 qh = ld128(bb + 16u + 16u * hh);
    uvec4 lo = (q & 0x0F0F0F0Fu) | (((qh >> (2u * p)) & 0x01010101u) << 4);
    uvec4 hi = ((q >> 4) & 0x0F0F0F0Fu) | (((qh >> (2u * p + 1u)) & 0x01010101u) << 4);
#endif
    [[unroll]] for (int j = 0; j < 4; ++j) {
        v[j] = u8x4(lo[j]) * d0 - m0;
        v[j + 4] = u8x4(hi[j]) * d1 - m1;
    }
}

#elif WTYPE == WT_Q6_K
// a unit: t = u % 8, half h = t/4, l0 = 8 * (t % 4); elements 128h + 32c + l0 + 0..7 for
// c = 0..3 (run j: c = j/2, +4 for odd j)
#define DQ_U 32u
#define DQ_NV 8
uint dq_run(uint u, uint j) {
    uint t = u & 7u;
    return 256u * (u >> 3) + 128u * (t >> 2) + 32u * (j >> 1) + 8u * (t & 3u) + 4u * (j & 1u);
}
void dq_unit(uint rb, uint u, out vec4 v[DQ_NV]) {
    uint bb = rb + (u >> 3) * QBYTES;
    uint t = u & 7u;
    uint h = t >> 2;
    uint l0 = 8u * (t & 3u);
    uint qa = bb + 64u * h + l0;          // ql bytes for c = 0, 2
    uint qb = qa + 32u;                   // ql bytes for c = 1, 3
    uint qhb = bb + 128u + 32u * h + l0;
    uvec2 A = uvec2(ld16x2(qa), ld16x2(qa + 4u));
    uvec2 B = uvec2(ld16x2(qb), ld16x2(qb + 4u));
    uvec2 H = uvec2(ld16x2(qhb), ld16x2(qhb + 4u));
    float d = h2f(ld16(bb + 208u));
    uint scb = bb + 192u + 8u * h + (l0 >> 4);
    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
        float dsc = d * float(bitfieldExtract(int(ld8(scb + 2u * c)), 0, 8));
        uvec2 ql = (((c & 1u) == 0u ? A : B) >> (4u * (c >> 1))) & 0x0F0F0F0Fu;
        uvec2 q = ql | (((H >> (2u * c)) & 0x03030303u) << 4);
        v[2u * c] = (u8x4(q.x) - 32.0) * dsc;
        v[2u * c + 1u] = (u8x4(q.y) - 32.0) * dsc;
    }
}
#endif

#endif
