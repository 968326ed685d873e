#version 450
// attn_combine_f32: merge the n_splits partial results of attn_f16_f32 (see attention.comp
// for the layout of `part`) into out[t, h, :] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
// One workgroup per (token, head) row. The split weights e^(m_s - M) are computed once per
// row, one split per invocation, into shared memory (rows of more than MAXS splits recompute
// them per element); then each invocation sums its output elements over the splits.
// attn_combine_q8_1_f32 (Q8 = 1; head_dim % 32 == 0, rows of n_heads * head_dim contiguous):
// the output is also written as q8_1 blocks into the scratch at binding 2 (shaders/q8_1.glsl:
// the bits quantize_q8_1.comp makes from it), for the integer-dot-product mat-vec of the
// attention output projection: one dispatch (and barrier level) fewer per decode layer.

#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x = 128) in;
#define NT 128u
#define MAXS 256u
#define UNR 8u
#define MAXD 256u  // the largest head_dim (ops/attention.py MAX_HEAD_DIM)
#ifndef Q8
#define Q8 0
#endif

layout(std430, binding = 0) readonly buffer Part { float part[]; };
layout(std430, binding = 1) writeonly buffer O { float o[]; };
#if Q8
layout(std430, binding = 2) writeonly buffer XQ { uint xq[]; };
layout(std430, binding = 2) writeonly buffer XQM { uvec2 xqm[]; };
#define Q8_WG NT
#include "q8_1.glsl"
#endif

layout(push_constant) uniform Push {
    uint n_rows;  // n_tokens * n_heads
    uint n_heads;
    uint hd;
    uint n_splits;
    uint o_off;
    uint o_stride;
} p;

shared float s_w[MAXS];      // e^(m_s - M) per split
#if Q8
shared float s_y[MAXD];      // the row's output, regrouped four elements per invocation
#endif
shared float s_red[NT];      // one partial per subgroup

// e^(m_s - M) of split s: from shared memory, recomputed past MAXS splits
float split_weight(uint s, uint row, float M) {
    return s < MAXS ? s_w[s] : exp(part[p.n_splits * p.n_rows * p.hd + (s * p.n_rows + row) * 2u] - M);
}

float wg_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) {
        s_red[gl_SubgroupID] = v;
    }
    barrier();
    float t = -3.0e38;
    for (uint i = 0u; i < gl_NumSubgroups; ++i) {
        t = max(t, s_red[i]);
    }
    barrier();
    return t;
}

float wg_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) {
        s_red[gl_SubgroupID] = v;
    }
    barrier();
    float t = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; ++i) {
        t += s_red[i];
    }
    barrier();
    return t;
}

void main() {
    const uint D = p.hd;
    const uint S = p.n_splits;
    const uint tid = gl_LocalInvocationID.x;
    const uint mlb = S * p.n_rows * D;
    for (uint row = gl_WorkGroupID.x; row < p.n_rows; row += gl_NumWorkGroups.x) {
        float m = -3.0e38;
        for (uint s = tid; s < S; s += NT) {
            m = max(m, part[mlb + (s * p.n_rows + row) * 2u]);
        }
        const float M = wg_max(m);
        float l = 0.0;
        for (uint s = tid; s < S; s += NT) {
            const uint b = mlb + (s * p.n_rows + row) * 2u;
            const float e = exp(part[b] - M);
            l += part[b + 1u] * e;
            if (s < MAXS) {
                s_w[s] = e;
            }
        }
        const float L = wg_sum(l);  // (its barriers also publish s_w)
        const float inv = L > 0.0 ? 1.0 / L : 0.0;
        const uint t = row / p.n_heads;
        const uint h = row - t * p.n_heads;
        const uint ob = p.o_off + t * p.o_stride + h * D;
        // one output element per invocation; the splits' partials loaded UNR at a time, all
        // before the first use (a loop of one load per iteration waits for each in turn),
        // summed in split order
        for (uint d = tid; d < D; d += NT) {
            float a = 0.0;
            uint s = 0u;
            for (; s + UNR <= S; s += UNR) {
                float v[UNR];
                [[unroll]] for (uint k = 0u; k < UNR; ++k) {
                    v[k] = part[((s + k) * p.n_rows + row) * D + d];
                }
                [[unroll]] for (uint k = 0u; k < UNR; ++k) {
                    a += v[k] * split_weight(s + k, row, M);
                }
            }
            for (; s < S; s++) {
                a += part[(s * p.n_rows + row) * D + d] * split_weight(s, row, M);
            }
            const float y = a * inv;
            o[ob + d] = y;
#if Q8
            s_y[d] = y;
#endif
        }
#if Q8
        barrier();  // s_y complete
        // x of the next product: rows of n_heads * D, 32-element blocks (D % 32 == 0); four
        // consecutive elements per invocation, 8 invocations per block
        const uint nb = (p.n_heads * D) >> 5;
        for (uint c0 = 0u; c0 < D; c0 += 4u * NT) {  // uniform: q8_1_store has barriers
            const uint c = c0 + 4u * tid;
            uint u[4];
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                u[i] = c < D ? floatBitsToUint(s_y[c + i]) : 0u;  // the bits written are the bits quantized
            }
            q8_1_store(tid, t * nb + ((h * D + c) >> 5), (p.n_rows / p.n_heads) * nb, c < D, u);
        }
#endif
        barrier();  // s_w is reused by the next row
    }
}
