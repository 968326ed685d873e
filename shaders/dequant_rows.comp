#version 450
// dequant_rows_<type>_f16: out[i K + k] = f16(dequant(W[row0 + i, k])) for i < n, k < K: rows
// of ggml weights decoded once to compact f16 rows (rounded once from dequant.glsl's f32
// values, as mul_mat_cm2's per-element decode rounds), which mul_mat_cm2's F16 kernel then
// reads: the dequantize-first path of a large product (mul_mat.py, dq16). Threads take 4
// consecutive elements each (dq4) and write them as one 8-byte store.
//
// Push constants: n, K (K % 4 == 0; the type's block size divides it), row0, out_offset (in
// elements, a multiple of 4). Workgroups: (ceil(K / (4 * 64)), min(n, 65535)); y loops over
// the rows.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

layout(local_size_x = 64) in;

layout(std430, binding = 1) writeonly buffer Out { uvec2 out4[]; };

layout(push_constant) uniform Push { uint n; uint K; uint row0; uint out_offset; } p;

void main() {
    const uint k = 4u * gl_GlobalInvocationID.x;
    if (k >= p.K) {
        return;
    }
    const uint row_bytes = ROW_BYTES(p.K);
    for (uint i = gl_WorkGroupID.y; i < p.n; i += gl_NumWorkGroups.y) {
        const vec4 v = dq4((p.row0 + i) * row_bytes, k);
        out4[(p.out_offset + i * p.K + k) >> 2] = uvec2(packHalf2x16(v.xy), packHalf2x16(v.zw));
    }
}
