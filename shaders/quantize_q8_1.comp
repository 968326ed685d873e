#version 450
// quantize_q8_1: the activation x (f32, M rows of K elements, K % 32 == 0) as 8-bit blocks
// of 32 for the integer-dot-product mat-vec (mul_mat_vecq.comp), in the style of ggml's q8_1.
//
// Per block of 32 elements x_i (column m, block b; blocks numbered j = m * nb + b, nb = K / 32):
//   amax = max |x_i|
//   d    = amax * C, C = fl32(1 / 127) (0x3C010204): one correctly rounded f32 multiply;
//          d = 0 when the product is not a normal float (all-zero and tiny blocks)
//   q_i  = round(x_i / d), rounded half AWAY from zero, computed exactly (integer division
//          of the f32 mantissas, never a float division: Vulkan's division is not correctly
//          rounded), clamped to [-127, 127] (never reached: |x_i| / d <= 127 (1 + 2^-22))
//   sum  = sum of q_i (an exact integer; Q4_0 subtracts 8 * sum * d_w * d instead of
//          offsetting each weight nibble)
// so the result is a deterministic function of the bits of x (numpy reproduces it exactly:
// vkxsplit.ops.mul_mat.q8_1_reference).
//
// Scratch layout (binding 1, 16-byte aligned; 40 bytes per block, vecq_scratch_bytes()):
//   bytes [0, 32 J):      block j's 32 int8 q_i as 8 words (uvec4 2j, 2j + 1), element 4w + k
//                         in byte k of word w (J = M * nb blocks)
//   bytes [32 J, 40 J):   block j's (floatBitsToUint(d), uint(sum)) as uvec2 4J + j
//
// x is read as raw bits (uint), so subnormal inputs are decoded exactly (never flushed).
// The block code is shaders/q8_1.glsl (rms_norm.comp with Q8 = 1 uses it too). SWIGLU = 1:
// swiglu_q8_1_f32, the SwiGLU of gate and up computed, written and quantized in one pass.
// Layout: 8 threads per block (4 elements each), WG / 8 blocks per workgroup; amax and sum
// are combined through shared memory (no subgroup operations: any subgroup size).
// Push constants as mul_mat_vec.comp (M, K, x_stride, x_offset used).
// Workgroups: ceil(M * nb / (WG / 8)) along x.
#extension GL_EXT_control_flow_attributes : require

#ifndef WG
#define WG 256
#endif
#define BPW (WG / 8)  // blocks per workgroup

layout(local_size_x = WG) in;

#ifndef SWIGLU
#define SWIGLU 0
#endif
#if SWIGLU
// swiglu_q8_1_f32: x = silu(gate) * up computed here (as elementwise.comp's swiglu), written
// as f32 to binding 2 (may be gate: each invocation reads its elements before writing them)
// and quantized from the same bits; gate, up and the output share the row layout.
layout(std430, binding = 0) readonly buffer G { float gate[]; };
layout(std430, binding = 1) readonly buffer U { float up[]; };
layout(std430, binding = 2) writeonly buffer D { float dst[]; };
#define XQ_BINDING 3
#else
layout(std430, binding = 0) readonly buffer X { uint xu[]; };
#define XQ_BINDING 1
#endif
layout(std430, binding = XQ_BINDING) writeonly buffer XQ { uint xq[]; };
layout(std430, binding = XQ_BINDING) writeonly buffer XQM { uvec2 xqm[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

#define Q8_WG WG
#include "q8_1.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sub = tid & 7u;                    // quarter-word of the block: elements 4 sub..
    const uint nb = p.K >> 5;
    const uint nblk = p.M * nb;
    const uint j = gl_WorkGroupID.x * BPW + (tid >> 3);
    const bool live = j < nblk;

    uint u[4];
    if (live) {
        const uint m = j / nb;
        const uint e = p.x_offset + m * p.x_stride + 32u * (j - m * nb) + 4u * sub;
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
#if SWIGLU
            const float g = gate[e + i];
            const float v = g / (1.0 + exp(-g)) * up[e + i];
            dst[e + i] = v;
            u[i] = floatBitsToUint(v);  // the bits written are the bits quantized
#else
            u[i] = xu[e + i];
#endif
        }
    } else {
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            u[i] = 0u;
        }
    }
    q8_1_store(tid, j, nblk, live, u);
}
