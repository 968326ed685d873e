#version 450
// mul_mat_coopmat_<type>_f32: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k] with
// GL_KHR_cooperative_matrix: f16 A/B fragments, f32 accumulators, 16x16x16, subgroup scope.
//
// A workgroup is 4 subgroups of 32 (the variant requires subgroup size 32) and computes a
// BM x BN = 64 x 128 tile of y; subgroup s owns rows 32 (s / 2) .. +31 and columns
// 64 (s % 2) .. +63, i.e. 2 x 4 accumulator fragments. Per BK = 32 step the x tile (f32 ->
// f16) and the dequantized W tile (dq4 -> f16) are written to shared memory row-major
// (xs[m][k], ws[n][k], rows padded to 40 halves = 80 bytes so every fragment load starts
// 16-byte aligned); A fragments load row-major from xs, B fragments (B[k][n] = W[n][k])
// column-major from ws. Results go through a per-subgroup 16x16 f32 staging area in shared
// memory so that edge tiles (M, N not multiples of the tile) are bounds-checked.
//
// Precision: both operands are rounded to f16 (x and dequantized W; F32/BF16 weights beyond
// the f16 range become inf), products accumulate in f32.
//
// Push constants: as mul_mat (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0,
// y_col0, flags). Workgroups: (ceil(N / BN), ceil(M / BM)).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require

#define W_BINDING 0
#include "dequant.glsl"

#define BM 64
#define BN 128
#define BK 32
#define SK 40          // shared row stride in halves (BK + 8)
#define WM 32          // subgroup tile
#define WN 64
#define FM (WM / 16)   // fragments per subgroup tile
#define FN (WN / 16)
#define NSG 4
#define SGS 32

layout(local_size_x = 128) in;

layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer X4 { vec4 x4[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

shared float16_t xs[BM * SK];
shared float16_t ws[BN * SK];
shared float cs[NSG * 256];

void main() {
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint sm = sg / 2u;
    const uint sn = sg % 2u;
    const uint row_bytes = ROW_BYTES(p.K);
    const bool xvec = (p.flags & 1u) != 0u;
#if DQ_FLOAT
    const bool wvec = (p.flags & 2u) != 0u;
#endif

    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[FM][FN];
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            acc[i][j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
        }
    }

    for (uint k0 = 0u; k0 < p.K; k0 += BK) {
        // W tile: BN rows x BK/4 quads, consecutive threads along a row
        [[unroll]] for (uint c = tid; c < BN * BK / 4u; c += 128u) {
            const uint n = c / (BK / 4u);
            const uint kq = c % (BK / 4u);
            const uint k = k0 + 4u * kq;
            vec4 v = vec4(0.0);
            if (n0 + n < p.N) {
                const uint rb = (p.w_row0 + n0 + n) * row_bytes;
#if DQ_FLOAT
                if (wvec) {
                    if (k < p.K) {
                        v = dq4(rb, k);
                    }
                } else {
                    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                        if (k + i < p.K) {
                            v[i] = dq1(rb, k + i);
                        }
                    }
                }
#else
                v = dq4(rb, k);
#endif
            }
            const uint o = n * SK + 4u * kq;
            ws[o] = float16_t(v.x);
            ws[o + 1u] = float16_t(v.y);
            ws[o + 2u] = float16_t(v.z);
            ws[o + 3u] = float16_t(v.w);
        }
        // x tile: BM rows x BK/4 quads
        [[unroll]] for (uint c = tid; c < BM * BK / 4u; c += 128u) {
            const uint m = c / (BK / 4u);
            const uint kq = c % (BK / 4u);
            const uint k = k0 + 4u * kq;
            vec4 v = vec4(0.0);
            if (m0 + m < p.M) {
                const uint xi = p.x_offset + (m0 + m) * p.x_stride + k;
                if (xvec) {
                    if (k < p.K) {
                        v = x4[xi >> 2];
                    }
                } else {
                    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                        if (k + i < p.K) {
                            v[i] = x[xi + i];
                        }
                    }
                }
            }
            const uint o = m * SK + 4u * kq;
            xs[o] = float16_t(v.x);
            xs[o + 1u] = float16_t(v.y);
            xs[o + 2u] = float16_t(v.z);
            xs[o + 3u] = float16_t(v.w);
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a[FM];
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b[FN];
            [[unroll]] for (uint i = 0u; i < FM; ++i) {
                coopMatLoad(a[i], xs, (sm * WM + 16u * i) * SK + kk, SK, gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                coopMatLoad(b[j], ws, (sn * WN + 16u * j) * SK + kk, SK, gl_CooperativeMatrixLayoutColumnMajor);
            }
            [[unroll]] for (uint i = 0u; i < FM; ++i) {
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);
                }
            }
        }
        barrier();
    }

    // out: each fragment through this subgroup's 16x16 staging area, bounds-checked
    const uint cbase = sg * 256u;
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            coopMatStore(acc[i][j], cs, cbase, 16u, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            const uint mb = m0 + sm * WM + 16u * i;
            const uint nb = n0 + sn * WN + 16u * j;
            [[unroll]] for (uint e = lane; e < 256u; e += SGS) {
                const uint m = mb + e / 16u;
                const uint n = nb + e % 16u;
                if (m < p.M && n < p.N) {
                    y[p.y_offset + m * p.y_stride + p.y_col0 + n] = cs[cbase + e];
                }
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
        }
    }
}
