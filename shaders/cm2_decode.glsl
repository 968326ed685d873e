// Weights for GL_NV_cooperative_matrix2 tensor loads: binding 0 seen as an array of ggml
// blocks (one QK-element run of one row each, byte-for-byte as in GGUF), and a decode function
// the driver calls for each element it stages (coopMatLoadTensorNV(..., DECODE)), with the
// block's address, the block's coordinates and the element's coordinates inside the block
// (row 0, column 0..QK-1). Layouts: ggml's block_* structs (ggml-common.h), the quant bytes
// declared as 16-bit pairs (elements 2i and 2i + 1 of a block read the same halfword: the
// driver decodes elements in pairs, and a pair whose loads are one load is decoded with one;
// ggml-vulkan's *_packed16 views), every member 1- or 2-byte aligned but Q5_1's 4-byte qh
// and Q4_K/Q5_K's header, read as one uvec4 (their
// 144- and 176-byte blocks are 16-byte aligned because record_mul_mat requires a 16-byte
// aligned weight binding), so std430 packs them without padding (sizes 18, 20, 22, 24, 34, 144,
// 176, 210, and 84, 110, 18, 136 for Q2_K, Q3_K, IQ4_NL, IQ4_XS = QBYTES of dequant.glsl).
//
// The including shader defines WTYPE (ggml type id); this file defines QK, CM2_DECODE
// (", dq_elem" or empty: F16 needs no decode) and the buffer w_blocks[]. The decode itself is
// cm2_dq_body.glsl, included into dq_elem (block B = r.b behind the driver's pointer) and, with
// CM2_SSBO_DECODE, into dq_ssbo (B = w_blocks[bi]); CM2_NO_REF leaves out the pointer type and
// dq_elem (no device addresses needed).
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
struct WBlock { float16_t d; uint16_t qs[8]; };
#elif WTYPE == WT_Q4_1
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; float16_t m; uint16_t qs[8]; };
#elif WTYPE == WT_Q5_0
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; uint16_t qh[2]; uint16_t qs[8]; };
#elif WTYPE == WT_Q5_1
#define QK 32
#define CM2_ALIGN 4
struct WBlock { float16_t d; float16_t m; uint qh; uint16_t qs[8]; };
#elif WTYPE == WT_Q8_0
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; uint16_t qs[16]; };
#elif WTYPE == WT_Q4_K
// ggml's block_q4_K: h = (d, dmin) half pair and the 12 bytes of 6-bit scales/mins as one
// uvec4, read with one 16-byte load (144-byte blocks of a 16-byte aligned binding); the
// nibbles (and Q5_K's high bits) as halfwords
#define QK 256
#define CM2_ALIGN 16
struct WBlock { uvec4 h; uint16_t qs[64]; };
#elif WTYPE == WT_Q5_K
#define QK 256
#define CM2_ALIGN 16
struct WBlock { uvec4 h; uint16_t qh[16]; uint16_t qs[64]; };  // 176 bytes
#elif WTYPE == WT_Q6_K
#define QK 256
#define CM2_ALIGN 2
struct WBlock { uint16_t ql[64]; uint16_t qh[32]; int8_t scales[16]; float16_t d; };
#elif WTYPE == WT_Q2_K
#define QK 256
#define CM2_ALIGN 4
struct WBlock { uint8_t scales[16]; uint16_t qs[32]; f16vec2 dm; };  // 84 bytes
#elif WTYPE == WT_Q3_K
#define QK 256
#define CM2_ALIGN 2
struct WBlock { uint16_t hmask[16]; uint16_t qs[32]; uint8_t scales[12]; float16_t d; };  // 110 bytes
#elif WTYPE == WT_IQ4_NL
#define QK 32
#define CM2_ALIGN 2
struct WBlock { float16_t d; uint16_t qs[8]; };
#elif WTYPE == WT_IQ4_XS
#define QK 256
#define CM2_ALIGN 8
struct WBlock { float16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint16_t qs[64]; };  // 136 bytes
#else
#error "unknown WTYPE"
#endif

layout(std430, binding = 0) readonly buffer WB { WBlock w_blocks[]; };

#if WTYPE == WT_IQ4_NL || WTYPE == WT_IQ4_XS
// ggml's kvalues_iq4nl
const float KV_IQ4NL[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                     1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
#endif

#ifndef CM2_NO_REF
layout(buffer_reference, std430, buffer_reference_align = CM2_ALIGN) readonly buffer WRef { WBlock b; };

float16_t dq_elem(const in WRef r, const in uint blockCoords[2], const in uint coordInBlock[2]) {
    const uint j = coordInBlock[1];
#define B r.b
#include "cm2_dq_body.glsl"
#undef B
}
#endif

#ifdef CM2_SSBO_DECODE
// the same decode of element j of block bi, read from the binding (cm2_decode_check.comp: the
// formulas checked against gguf's dequantize on any device, without coopmat2 or device addresses)
float16_t dq_ssbo(const uint bi, const uint j) {
#define B w_blocks[bi]
#include "cm2_dq_body.glsl"
#undef B
}
#endif
#endif  // WTYPE != F16

#endif
