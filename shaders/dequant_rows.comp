#version 450
// dequant_rows_<type>_f16: out[i K + k] = f16(dequant(W[row0 + i, k])) for i < n, k < K: rows
// of ggml weights decoded once to compact f16 rows (rounded once from dequant.glsl's f32
// values, as mul_mat_cm2's per-element decode rounds), which mul_mat_cm2's F16 kernel then
// reads: the dequantize-first path of a large product (mul_mat.py, dq16). Threads take 8
// consecutive elements (two dq4) and write them as one 16-byte store; a workgroup of 256
// covers 2048 elements of a row and loops over rows (a bandwidth-bound pass: few, busy
// workgroups; the first version, 64 threads of one 8-byte store each and a workgroup per
// row slice, moved ~1.05 TB/s on the H200).
//
// Push constants: n, K (K % 8 == 0; the type's block size divides it), row0, out_offset (in
// elements, a multiple of 8). Workgroups: (ceil(K / 2048), rows y = min(n, ROW_GROUPS)); y
// loops over the rows.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

layout(local_size_x = 256) in;

layout(std430, binding = 1) writeonly buffer Out { uvec4 out8[]; };

layout(push_constant) uniform Push { uint n; uint K; uint row0; uint out_offset; } p;

void main() {
    const uint k = 8u * gl_GlobalInvocationID.x;
    if (k >= p.K) {
        return;
    }
    const uint row_bytes = ROW_BYTES(p.K);
    for (uint i = gl_WorkGroupID.y; i < p.n; i += gl_NumWorkGroups.y) {
        const uint rb = (p.row0 + i) * row_bytes;
        const vec4 a = dq4(rb, k);
        const vec4 b = dq4(rb, k + 4u);
        out8[(p.out_offset + i * p.K + k) >> 3] =
            uvec4(packHalf2x16(a.xy), packHalf2x16(a.zw), packHalf2x16(b.xy), packHalf2x16(b.zw));
    }
}
