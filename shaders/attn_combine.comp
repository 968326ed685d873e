#version 450
// attn_combine_f32: merge the n_splits partial results of attn_f16_f32 (see attention.comp
// for the layout of `part`) into out[t, h, :] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
// One workgroup per (token, head) row.

layout(local_size_x = 128) in;
#define NT 128u

layout(std430, binding = 0) readonly buffer Part { float part[]; };
layout(std430, binding = 1) writeonly buffer O { float o[]; };

layout(push_constant) uniform Push {
    uint n_rows;  // n_tokens * n_heads
    uint n_heads;
    uint hd;
    uint n_splits;
    uint o_off;
    uint o_stride;
} p;

void main() {
    const uint D = p.hd;
    const uint mlb = p.n_splits * p.n_rows * D;
    for (uint row = gl_WorkGroupID.x; row < p.n_rows; row += gl_NumWorkGroups.x) {
        float M = -3.0e38;
        for (uint s = 0u; s < p.n_splits; s++) {
            M = max(M, part[mlb + (s * p.n_rows + row) * 2u]);
        }
        float L = 0.0;
        for (uint s = 0u; s < p.n_splits; s++) {
            uint b = mlb + (s * p.n_rows + row) * 2u;
            L += part[b + 1u] * exp(part[b] - M);
        }
        float inv = L > 0.0 ? 1.0 / L : 0.0;
        uint t = row / p.n_heads;
        uint h = row - t * p.n_heads;
        for (uint d = gl_LocalInvocationID.x; d < D; d += NT) {
            float a = 0.0;
            for (uint s = 0u; s < p.n_splits; s++) {
                a += part[(s * p.n_rows + row) * D + d] * exp(part[mlb + (s * p.n_rows + row) * 2u] - M);
            }
            o[p.o_off + t * p.o_stride + h * D + d] = a * inv;
        }
    }
}
