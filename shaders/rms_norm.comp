#version 450
// rms_norm_f32 / rms_norm_mul_f32: y = x / sqrt(mean(x^2) + eps) over each row of a 2-D f32
// tensor, optionally times a weight row vector w (FUSE_MUL = 1: what llama does). One
// workgroup per row (looping when rows exceed the dispatch); f32 accumulation, reduced with
// subgroupAdd and then across subgroups in shared memory. In-place use (dst == x) is allowed.
// add_rms_norm_mul_f32 (FUSE_ADD = 1, with FUSE_MUL): first x += r (the residual add, written
// back to x), then y = rms_norm(x) * w: one dispatch, one barrier level, instead of two.
// *_q8_1_f32 (Q8 = 1, with FUSE_MUL; ncols % 32 == 0): y is also written as q8_1 blocks into
// the scratch at the last binding (shaders/q8_1.glsl: the same bits quantize_q8_1.comp makes
// from y), for the integer-dot-product mat-vecs that read y next: one dispatch (and barrier
// level) fewer per quantized x.
// A row is walked in chunks of 4 * WG elements, four consecutive ones per invocation (8
// invocations per 32-element q8_1 block). A decode step has one row per dispatch, so one
// workgroup does all the work and the time is memory latency, not bandwidth: a row of at most
// MAXCH chunks (8 x 4 x WG elements) is loaded at once into registers (every load issued before the
// first use), kept there for the output pass and never read back; longer rows take the same
// path chunk by chunk, reading x again for the output.
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

// WG: the workgroup size (constant_id 0): 256 for many rows, 1024 for the one row of a decode
// step (a quarter of the serial work per invocation: a wide row's four chunks become one)
layout(constant_id = 0) const uint WG = 256u;
layout(local_size_x_id = 0) in;
#ifndef Q8
#define Q8 0
#endif

#if FUSE_ADD
layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer R { float r[]; };
layout(std430, binding = 2) readonly buffer W { float w[]; };
layout(std430, binding = 3) writeonly buffer Dst { float d[]; };
#else
layout(std430, binding = 0) readonly buffer X { float x[]; };
#endif
#if FUSE_ADD
#elif FUSE_MUL
layout(std430, binding = 1) readonly buffer W { float w[]; };
layout(std430, binding = 2) writeonly buffer Dst { float d[]; };
#else
layout(std430, binding = 1) writeonly buffer Dst { float d[]; };
#endif

#if Q8
#if FUSE_ADD
#define Q8_BINDING 4
#else
#define Q8_BINDING 3
#endif
layout(std430, binding = Q8_BINDING) writeonly buffer XQ { uint xq[]; };
layout(std430, binding = Q8_BINDING) writeonly buffer XQM { uvec2 xqm[]; };
#define Q8_WG WG
#include "q8_1.glsl"
#endif

layout(push_constant) uniform Push {
    uint ncols;
    uint nrows;
    uint x_off;
    uint x_stride;
    uint w_off;
    uint d_off;
    uint d_stride;
    float eps;
    uint r_off;
    uint r_stride;
} p;

#define MAXCH 8u
#define STEP (4u * WG)

// one partial per subgroup (sized for 1-wide subgroups, the worst case)
shared float red[WG];

float row_sum(float s) {
    s = subgroupAdd(s);
    if (subgroupElect()) {
        red[gl_SubgroupID] = s;
    }
    barrier();
    float t = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; ++i) {
        t += red[i];
    }
    barrier();  // red[] is reused by the next row
    return t;
}

// the four outputs of invocation tid in the chunk at c0: written to d (and quantized)
void store4(uint row, uint db, uint c0, uint tid, float y[4]) {
    const uint c = c0 + 4u * tid;
    const bool live = c < p.ncols;
#if Q8
    uint u[4];
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
        u[i] = 0u;
        if (live) {
            d[db + c + i] = y[i];
            u[i] = floatBitsToUint(y[i]);  // the bits written are the bits quantized
        }
    }
    const uint nb = p.ncols >> 5;
    q8_1_store(tid, row * nb + (c >> 5), p.nrows * nb, live, u);
#else
    if (live) {
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            if (c + i < p.ncols) {
                d[db + c + i] = y[i];
            }
        }
    }
#endif
}

float weight(uint c) {
#if FUSE_MUL
    return w[p.w_off + c];
#else
    return 1.0;
#endif
}

// x (plus the residual, written back) at column c, 0 past the row
float load_x(uint xb, uint rb, uint c) {
    if (c >= p.ncols) {
        return 0.0;
    }
#if FUSE_ADD
    const float v = x[xb + c] + r[rb + c];
    x[xb + c] = v;  // read back below by this same invocation only
    return v;
#else
    return x[xb + c];
#endif
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint nch = (p.ncols + STEP - 1u) / STEP;
    for (uint row = gl_WorkGroupID.x; row < p.nrows; row += gl_NumWorkGroups.x) {
        const uint xb = p.x_off + row * p.x_stride;
        const uint db = p.d_off + row * p.d_stride;
#if FUSE_ADD
        const uint rb = p.r_off + row * p.r_stride;
#else
        const uint rb = 0u;
#endif
        if (nch <= MAXCH) {  // uniform: the whole row in registers
            float v[4u * MAXCH];
            float s = 0.0;
            [[unroll]] for (uint k = 0u; k < MAXCH; ++k) {
                [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                    v[4u * k + i] = k < nch ? load_x(xb, rb, k * STEP + 4u * tid + i) : 0.0;
                }
            }
            [[unroll]] for (uint k = 0u; k < 4u * MAXCH; ++k) {
                s += v[k] * v[k];
            }
            const float scale = 1.0 / sqrt(row_sum(s) / float(p.ncols) + p.eps);
            [[unroll]] for (uint k = 0u; k < MAXCH; ++k) {
                if (k < nch) {  // uniform
                    float y[4];
                    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                        const uint c = k * STEP + 4u * tid + i;
                        y[i] = c < p.ncols ? (v[4u * k + i] * scale) * weight(c) : 0.0;
                    }
                    store4(row, db, k * STEP, tid, y);
                }
            }
        } else {
            float s = 0.0;
            for (uint c0 = 0u; c0 < p.ncols; c0 += STEP) {
                [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                    const float t = load_x(xb, rb, c0 + 4u * tid + i);
                    s += t * t;
                }
            }
            const float scale = 1.0 / sqrt(row_sum(s) / float(p.ncols) + p.eps);
            for (uint c0 = 0u; c0 < p.ncols; c0 += STEP) {  // uniform: q8_1_store has barriers
                float y[4];
                [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                    const uint c = c0 + 4u * tid + i;
                    y[i] = c < p.ncols ? (x[xb + c] * scale) * weight(c) : 0.0;
                }
                store4(row, db, c0, tid, y);
            }
        }
    }
}
