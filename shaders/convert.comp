#version 450
// convert_<src>_<dst>: elementwise conversion between f32, f16 and bf16 for contiguous
// tensors of any length. SRC_TYPE / DST_TYPE: 0 = f32, 1 = f16, 2 = bf16.
// ROWS=1 (convert_rows_<src>_<dst>): n elements of each of the rows gl_WorkGroupID.y, read at
// src_offset + row * src_stride, written compact at dst_offset + row * n (strided activations
// to the f16 operand of mul_mat_cm2).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#include "common.glsl"

layout(local_size_x = 256) in;

#if SRC_TYPE == 0
layout(std430, binding = 0) readonly buffer Src { uint src[]; };
#else
layout(std430, binding = 0) readonly buffer Src { uint16_t src[]; };
#endif
#if DST_TYPE == 0
layout(std430, binding = 1) writeonly buffer Dst { uint dst[]; };
#else
layout(std430, binding = 1) writeonly buffer Dst { uint16_t dst[]; };
#endif

#ifndef ROWS
#define ROWS 0
#endif
#if ROWS
layout(push_constant) uniform Push { uint n; uint src_offset; uint dst_offset; uint src_stride; } p;
#else
layout(push_constant) uniform Push { uint n; uint src_offset; uint dst_offset; } p;
#endif

void main() {
    uint stride = gl_NumWorkGroups.x * 256u;
#if ROWS
    const uint so = p.src_offset + gl_WorkGroupID.y * p.src_stride, dso = p.dst_offset + gl_WorkGroupID.y * p.n;
#else
    const uint so = p.src_offset, dso = p.dst_offset;
#endif
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        uint v = uint(src[so + i]);
#if SRC_TYPE == 1
        v = f16_bits_to_f32(v);
#elif SRC_TYPE == 2
        v = bf16_bits_to_f32(v);
#endif
#if DST_TYPE == 0
        dst[dso + i] = v;
#elif DST_TYPE == 1
        dst[dso + i] = uint16_t(f32_to_f16_bits(v));
#else
        dst[dso + i] = uint16_t(f32_to_bf16_bits(v));
#endif
    }
}
