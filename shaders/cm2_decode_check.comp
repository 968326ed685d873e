#version 450
// cm2_decode_check_<type>: out[e] = the mul_mat_cm2 decode (cm2_dq_body.glsl) of element e of
// the weight blocks in binding 0, as f16 bits, for e < n. A test kernel: the decode formulas of
// every type are checked against gguf's dequantize on any device (tests/test_mul_mat_cm2.py),
// where the coopmat2 kernels themselves need the H200.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_GOOGLE_include_directive : require

layout(local_size_x = 64) in;

#define CM2_NO_REF 1
#define CM2_SSBO_DECODE 1
#include "cm2_decode.glsl"

layout(std430, binding = 1) writeonly buffer Out { uint16_t out_bits[]; };
layout(push_constant) uniform Push { uint n; } p;

void main() {
    const uint e = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * 64u;
    if (e < p.n)
        out_bits[e] = float16BitsToUint16(dq_ssbo(e / QK, e % QK));
}
