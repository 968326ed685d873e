#version 450
// attn_combine_f32: merge the n_splits partial results of attn_f16_f32 (see attention.comp
// for the layout of `part`) into out[t, h, :] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
// One workgroup per (token, head) row (grid-stride over the rows). The math and its order of
// summation are attn_combine.glsl's, which attention.comp's FOLD runs too (same bits): the
// split weights e^(m_s - M) are computed once per row into shared memory (rows of more than
// MAXS splits recompute them per element); then each invocation sums its output elements over
// the splits.
// attn_combine_q8_1_f32 (Q8 = 1; head_dim % 32 == 0, rows of n_heads * head_dim contiguous):
// the output is also written as q8_1 blocks into the scratch at binding 2 (shaders/q8_1.glsl:
// the bits quantize_q8_1.comp makes from it), for the integer-dot-product mat-vec of the
// attention output projection: one dispatch (and barrier level) fewer per decode layer.

#extension GL_EXT_control_flow_attributes : require

layout(local_size_x = 128) in;
#define NT 128u
#define MAXS 256u
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

shared float s_w[MAXS];  // e^(m_s - M) per split
#if Q8
shared float s_y[MAXD];  // the row's output, regrouped four elements per invocation
#endif

uint cur_row;  // the row this workgroup merges now
uint cb_row(uint r) { return cur_row; }

#define CB_NT NT
#define CB_WS MAXS
#define CB_WGET(i) s_w[i]
#define CB_WSET(i, v) s_w[i] = (v)
#define CB_U 1u
#define CB_UNR 8u
#if Q8
#define CB_OUT(r, row, d, y) o_store(row, d, y); s_y[d] = (y)
#define CB_YGET(i) s_y[i]
#else
#define CB_OUT(r, row, d, y) o_store(row, d, y)
#endif

void o_store(uint row, uint d, float y) {
    const uint t = row / p.n_heads;
    o[p.o_off + t * p.o_stride + (row - t * p.n_heads) * p.hd + d] = y;
}

#include "attn_combine.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint mlb = p.n_splits * p.n_rows * p.hd;
    for (uint row = gl_WorkGroupID.x; row < p.n_rows; row += gl_NumWorkGroups.x) {
        cur_row = row;
        cb_weights(tid, 1u, p.n_splits, p.n_rows, mlb);
        cb_output(tid, 1u, p.n_splits, p.n_rows, mlb, p.hd);
#if Q8
        cb_q8(tid, 1u, p.hd, p.n_rows * p.hd / 32u);
#endif
        barrier();  // s_w, s_y and cb_* are reused by the next row
    }
}
