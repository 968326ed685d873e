#version 450
// get_rows_<type>_f32: out[out_offset + i * out_stride + k] = dequant(W[ids[ids_offset + i], k])
// (embedding lookup). Threads take 4 consecutive elements each (dq4, dequant.glsl); an id
// outside [0, n_rows) yields a row of NaN instead of an out-of-bounds read.
//
// Push constants: n_ids, K, n_rows, ids_offset, out_offset, out_stride, flags (bit 1: float
// W rows vec4-readable, K % 4 == 0; bit 2: W holds rows row0 .. row0 + n_rows - 1 of a larger
// table, too large for one binding: an id in that range reads row id - row0, any other id is
// skipped, its output row left to the dispatch of the part that holds it), row0. Workgroups: (ceil(K / (4 * 64)), min(n_ids, 65535));
// y loops over the ids.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

layout(local_size_x = 64) in;

layout(std430, binding = 1) readonly buffer Ids { int ids[]; };
layout(std430, binding = 2) writeonly buffer Out { float outv[]; };

layout(push_constant) uniform Push {
    uint n_ids; uint K; uint n_rows; uint ids_offset; uint out_offset; uint out_stride; uint flags;
    uint row0;
} p;

void main() {
    const uint k = 4u * gl_GlobalInvocationID.x;
    if (k >= p.K) {
        return;
    }
    const uint row_bytes = ROW_BYTES(p.K);
    for (uint i = gl_WorkGroupID.y; i < p.n_ids; i += gl_NumWorkGroups.y) {
        int id = ids[p.ids_offset + i];
        if ((p.flags & 4u) != 0u) {
            id -= int(p.row0);
            if (id < 0 || uint(id) >= p.n_rows) {
                continue;  // another part's row
            }
        }
        const uint ob = p.out_offset + i * p.out_stride + k;
        vec4 v;
        if (id < 0 || uint(id) >= p.n_rows) {
            v = vec4(uintBitsToFloat(0x7FC00000u));
        } else {
            const uint rb = uint(id) * row_bytes;
#if DQ_FLOAT
            if ((p.flags & 2u) != 0u) {
                v = dq4(rb, k);
            } else {
                v = vec4(0.0);
                [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                    if (k + j < p.K) {
                        v[j] = dq1(rb, k + j);
                    }
                }
            }
#else
            v = dq4(rb, k);
#endif
        }
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            if (k + j < p.K) {
                outv[ob + j] = v[j];
            }
        }
    }
}
