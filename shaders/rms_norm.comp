#version 450
// rms_norm_f32 / rms_norm_mul_f32: y = x / sqrt(mean(x^2) + eps) over each row of a 2-D f32
// tensor, optionally times a weight row vector w (FUSE_MUL = 1: what llama does). One
// workgroup per row (looping when rows exceed the dispatch); f32 accumulation with a
// shared-memory tree reduction. In-place use (dst == x) is allowed.
// add_rms_norm_mul_f32 (FUSE_ADD = 1, with FUSE_MUL): first x += r (the residual add, written
// back to x), then y = rms_norm(x) * w: one dispatch, one barrier level, instead of two.
// *_q8_1_f32 (Q8 = 1, with FUSE_MUL; ncols % 32 == 0): y is also written as q8_1 blocks into
// the scratch at the last binding (shaders/q8_1.glsl: the same bits quantize_q8_1.comp makes
// from y), for the integer-dot-product mat-vecs that read y next: one dispatch (and barrier
// level) fewer per quantized x. Rows are processed in chunks of 4 * WG elements there, four
// consecutive ones per invocation, 8 invocations per 32-element block.

#extension GL_EXT_control_flow_attributes : require

layout(local_size_x = 256) in;
#define WG 256u
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

shared float red[WG];

void main() {
    uint tid = gl_LocalInvocationID.x;
    for (uint row = gl_WorkGroupID.x; row < p.nrows; row += gl_NumWorkGroups.x) {
        uint xb = p.x_off + row * p.x_stride;
        uint db = p.d_off + row * p.d_stride;
        float s = 0.0;
#if FUSE_ADD
        uint rb = p.r_off + row * p.r_stride;
#endif
        for (uint c = tid; c < p.ncols; c += WG) {
#if FUSE_ADD
            float v = x[xb + c] + r[rb + c];
            x[xb + c] = v;  // read back below by this same invocation only
#else
            float v = x[xb + c];
#endif
            s += v * v;
        }
        red[tid] = s;
        barrier();
        for (uint k = WG / 2u; k > 0u; k >>= 1) {
            if (tid < k) {
                red[tid] += red[tid + k];
            }
            barrier();
        }
        float scale = 1.0 / sqrt(red[0] / float(p.ncols) + p.eps);
        barrier();  // red[] is reused by the next row
#if Q8
        const uint nb = p.ncols >> 5;
        for (uint c0 = 0u; c0 < p.ncols; c0 += 4u * WG) {  // uniform: q8_1_store has barriers
            const uint c = c0 + 4u * tid;
            const bool live = c < p.ncols;
            uint u[4];
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                u[i] = 0u;
                if (live) {
                    const float v = (x[xb + c + i] * scale) * w[p.w_off + c + i];
                    d[db + c + i] = v;
                    u[i] = floatBitsToUint(v);  // the bits written are the bits quantized
                }
            }
            q8_1_store(tid, row * nb + (c >> 5), p.nrows * nb, live, u);
        }
#else
        for (uint c = tid; c < p.ncols; c += WG) {
#if FUSE_MUL
            d[db + c] = (x[xb + c] * scale) * w[p.w_off + c];
#else
            d[db + c] = x[xb + c] * scale;
#endif
        }
#endif
    }
}
