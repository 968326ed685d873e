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

layout(std430, binding = 0) readonly buffer X { uint xu[]; };
layout(std430, binding = 1) writeonly buffer XQ { uint xq[]; };
layout(std430, binding = 1) writeonly buffer XQM { uvec2 xqm[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

shared uint s_amax[WG];
shared int s_sum[WG];

// round(|x| / d) half away from zero for the bits a = |x| (< inf) and a normal d (exponent
// field ed, mantissa md with the implicit bit): floor(2 |x| / d) by integer division, then
// (n + 1) / 2 = floor(|x| / d + 1/2)
uint quant_mag(uint a, uint ed, uint md) {
    if (a == 0u) {
        return 0u;
    }
    uint ex = a >> 23;
    uint mx = a & 0x7FFFFFu;
    if (ex == 0u) {
        ex = 1u;  // subnormal: no implicit bit, exponent of the smallest normal
    } else {
        mx |= 0x800000u;
    }
    // 2 |x| / d = mx / md * 2^s
    const int s = min(int(ex) - int(ed) + 1, 8);  // <= 8 for |x| <= amax (mx << 8 < 2^32)
    uint n;
    if (s >= 0) {
        n = (mx << uint(s)) / md;
    } else if (s > -25) {
        n = (mx >> uint(-s)) / md;  // floor(floor(mx / 2^-s) / md) = floor(mx / (2^-s md))
    } else {
        n = 0u;
    }
    return min((n + 1u) >> 1, 127u);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sub = tid & 7u;                    // quarter-word of the block: elements 4 sub..
    const uint nb = p.K >> 5;
    const uint nblk = p.M * nb;
    const uint j = gl_WorkGroupID.x * BPW + (tid >> 3);
    const bool live = j < nblk;

    uint u[4];
    uint am = 0u;
    if (live) {
        const uint m = j / nb;
        const uint e = p.x_offset + m * p.x_stride + 32u * (j - m * nb) + 4u * sub;
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            u[i] = xu[e + i];
            am = max(am, u[i] & 0x7FFFFFFFu);
        }
    } else {
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            u[i] = 0u;
        }
    }
    s_amax[tid] = am;
    barrier();
    uint amax = 0u;
    [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        amax = max(amax, s_amax[(tid & ~7u) + i]);
    }
    precise float d = uintBitsToFloat(amax) * uintBitsToFloat(0x3C010204u);
    uint db = floatBitsToUint(d);
    if (db < 0x00800000u || db >= 0x7F800000u) {
        db = 0u;  // not a normal float: an all-zero (or tiny) block
    }
    const uint ed = db >> 23;
    const uint md = (db & 0x7FFFFFu) | 0x800000u;

    uint word = 0u;
    int sum = 0;
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
        const int qa = db == 0u ? 0 : int(quant_mag(u[i] & 0x7FFFFFFFu, ed, md));
        const int q = (u[i] & 0x80000000u) != 0u ? -qa : qa;
        sum += q;
        word |= (uint(q) & 0xFFu) << (8u * i);
    }
    s_sum[tid] = sum;
    barrier();
    if (live) {
        xq[8u * j + sub] = word;
        if (sub == 0u) {
            int total = 0;
            [[unroll]] for (uint i = 0u; i < 8u; ++i) {
                total += s_sum[tid + i];
            }
            xqm[4u * nblk + j] = uvec2(db, uint(total));
        }
    }
}
