// Weights for GL_NV_cooperative_matrix2 tensor loads: binding 0 seen as an array of ggml
// blocks (one QK-element run of one row each, byte-for-byte as in GGUF), and a decode function
// the driver calls for each element it stages (coopMatLoadTensorNV(..., DECODE)), with the
// block's address, the block's coordinates and the element's coordinates inside the block
// (row 0, column 0..QK-1). Layouts: ggml's block_* structs (ggml-common.h), every member 1- or
// 2-byte aligned but Q5_1's 4-byte qh, so std430 packs them without padding (sizes 18, 20, 22,
// 24, 34, 144, 176, 210 bytes = QBYTES of dequant.glsl).
//
// The including shader defines WTYPE (ggml type id); this file defines QK, CM2_DECODE
// (", dq_elem" or empty: F16 needs no decode) and the buffer w_blocks[].
#ifndef VKX_CM2_DECODE_GLSL
#define VKX_CM2_DECODE_GLSL

#include "ggml_types.glsl"

#if WTYPE == WT_F16
#define QK 1
#define CM2_DECODE
layout(std430, binding = 0) readonly buffer WB { float16_t w_blocks[]; };
#else
#define CM2_DECODE , dq_elem

#if WTYPE == WT_F32
#define QK 1
#define CM2_ALIGN 4
struct WBlock { float v; };
#elif WTYPE == WT_BF16
#define QK 1
#define CM2_ALIGN 2
struct WBlock { uint16_t v; };
#elif WTYPE == WT_Q4_0
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; uint8_t qs[16]; };
#elif WTYPE == WT_Q4_1
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; float16_t m; uint8_t qs[16]; };
#elif WTYPE == WT_Q5_0
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; uint8_t qh[4]; uint8_t qs[16]; };
#elif WTYPE == WT_Q5_1
#define QK 32
#define CM2_ALIGN 4
struct WBlock { float16_t d; float16_t m; uint qh; uint8_t qs[16]; };
#elif WTYPE == WT_Q8_0
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; int8_t qs[32]; };
#elif WTYPE == WT_Q4_K
#define QK 256
#define CM2_ALIGN 2
struct WBlock { float16_t d; float16_t dmin; uint8_t scales[12]; uint8_t qs[128]; };
#elif WTYPE == WT_Q5_K
#define QK 256
#define CM2_ALIGN 2
struct WBlock { float16_t d; float16_t dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
#elif WTYPE == WT_Q6_K
#define QK 256
#define CM2_ALIGN 2
struct WBlock { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; float16_t d; };
#else
#error "unknown WTYPE"
#endif

layout(std430, binding = 0) readonly buffer WB { WBlock w_blocks[]; };
layout(buffer_reference, std430, buffer_reference_align = CM2_ALIGN) readonly buffer WRef { WBlock b; };

#if WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
// ggml's get_scale_min_k4: 6-bit scale and min of sub-block s (0..7) of a K-quant block
uvec2 cm2_scale_min(const in WRef r, uint s) {
    if (s < 4u)
        return uvec2(uint(r.b.scales[s]) & 63u, uint(r.b.scales[s + 4u]) & 63u);
    uint hi = uint(r.b.scales[s + 4u]);
    return uvec2((hi & 15u) | ((uint(r.b.scales[s - 4u]) >> 6) << 4),
                 (hi >> 4) | ((uint(r.b.scales[s]) >> 6) << 4));
}
#endif

float16_t dq_elem(const in WRef r, const in uint blockCoords[2], const in uint coordInBlock[2]) {
    const uint j = coordInBlock[1];
#if WTYPE == WT_F32
    return float16_t(r.b.v);
#elif WTYPE == WT_BF16
    return float16_t(uintBitsToFloat(uint(r.b.v) << 16));
#elif WTYPE == WT_Q4_0 || WTYPE == WT_Q4_1
    const uint q = (uint(r.b.qs[j & 15u]) >> ((j & 16u) >> 2)) & 15u;
#if WTYPE == WT_Q4_0
    return float16_t(float(int(q) - 8) * float(r.b.d));
#else
    return float16_t(float(q) * float(r.b.d) + float(r.b.m));
#endif
#elif WTYPE == WT_Q5_0 || WTYPE == WT_Q5_1
    const uint lo = (uint(r.b.qs[j & 15u]) >> ((j & 16u) >> 2)) & 15u;
#if WTYPE == WT_Q5_0
    const uint h = (uint(r.b.qh[j >> 3]) >> (j & 7u)) & 1u;
    return float16_t(float(int(lo | (h << 4)) - 16) * float(r.b.d));
#else
    const uint h = (r.b.qh >> j) & 1u;
    return float16_t(float(lo | (h << 4)) * float(r.b.d) + float(r.b.m));
#endif
#elif WTYPE == WT_Q8_0
    return float16_t(float(int(r.b.qs[j])) * float(r.b.d));
#elif WTYPE == WT_Q4_K || WTYPE == WT_Q5_K
    const uint g = j >> 6, l = j & 63u;              // 64-element group, element in it
    const uvec2 sm = cm2_scale_min(r, 2u * g + (l >> 5));
    uint q = (uint(r.b.qs[32u * g + (l & 31u)]) >> ((l & 32u) >> 3)) & 15u;
#if WTYPE == WT_Q5_K
    q |= ((uint(r.b.qh[l & 31u]) >> (2u * g + (l >> 5))) & 1u) << 4;
#endif
    return float16_t(float(r.b.d) * float(sm.x) * float(q) - float(r.b.dmin) * float(sm.y));
#elif WTYPE == WT_Q6_K
    const uint half_ = j >> 7, quarter = (j >> 5) & 3u, l = j & 31u;
    const uint lo = (uint(r.b.ql[64u * half_ + l + 32u * (quarter & 1u)]) >> (4u * (quarter >> 1))) & 15u;
    const uint hb = (uint(r.b.qh[32u * half_ + l]) >> (2u * quarter)) & 3u;
    const int sc = int(r.b.scales[8u * half_ + (l >> 4) + 2u * quarter]);
    return float16_t(float(r.b.d) * float(sc) * float(int(lo | (hb << 4)) - 32));
#endif
}
#endif  // WTYPE != F16

#endif
