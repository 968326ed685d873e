#version 450
// mul_mat_<type>_f32: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k], tiled for larger M.
// A workgroup of 256 threads computes a BM x BN tile of y (BM rows of x, BN rows of W) in
// f32; each thread holds TM x TN results (rows ty + 16 i, columns tx + 16 j). Per BK step
// the x tile is loaded and the W tile dequantized (dq4, dequant.glsl) into shared memory,
// both stored k-major. Edges (M, N, and K for float types) are bounds-checked and zero-filled.
//
// Push constants: as mul_mat_vec (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0,
// y_col0, flags); flags bit 0: x rows vec4-aligned, bit 1: float W rows vec4-readable (K % 4 == 0).
// Workgroups: (ceil(N / BN), ceil(M / BM)).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

#define BM 64
#define BN 64
#define BK 32
#define TM 4
#define TN 4

layout(local_size_x = 256) in;

layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer X4 { vec4 x4[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

shared float xs[BK][BM];
shared float ws[BK][BN];

void main() {
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % 16u;
    const uint ty = tid / 16u;
    const uint row_bytes = ROW_BYTES(p.K);
    const bool xvec = (p.flags & 1u) != 0u;
#if DQ_FLOAT
    const bool wvec = (p.flags & 2u) != 0u;
#endif

    float acc[TM][TN];
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        [[unroll]] for (uint j = 0u; j < TN; ++j) {
            acc[i][j] = 0.0;
        }
    }

    for (uint k0 = 0u; k0 < p.K; k0 += BK) {
        // W tile: BN rows x BK/4 quads
        [[unroll]] for (uint c = tid; c < BN * BK / 4u; c += 256u) {
            const uint n = c % BN;
            const uint kq = c / BN;
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
                v = dq4(rb, k);  // K % QK == 0 and BK % QK == 0 or QK % BK == 0: always inside
#endif
            }
            ws[4u * kq][n] = v.x;
            ws[4u * kq + 1u][n] = v.y;
            ws[4u * kq + 2u][n] = v.z;
            ws[4u * kq + 3u][n] = v.w;
        }
        // x tile: BM rows x BK/4 quads
        [[unroll]] for (uint c = tid; c < BM * BK / 4u; c += 256u) {
            const uint m = c % BM;
            const uint kq = c / BM;
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
            xs[4u * kq][m] = v.x;
            xs[4u * kq + 1u][m] = v.y;
            xs[4u * kq + 2u][m] = v.z;
            xs[4u * kq + 3u][m] = v.w;
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float a[TM];
            float b[TN];
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                a[i] = xs[kk][ty + 16u * i];
            }
            [[unroll]] for (uint j = 0u; j < TN; ++j) {
                b[j] = ws[kk][tx + 16u * j];
            }
            [[unroll]] for (uint i = 0u; i < TM; ++i) {
                [[unroll]] for (uint j = 0u; j < TN; ++j) {
                    acc[i][j] = fma(a[i], b[j], acc[i][j]);
                }
            }
        }
        barrier();
    }

    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        const uint m = m0 + ty + 16u * i;
        if (m < p.M) {
            [[unroll]] for (uint j = 0u; j < TN; ++j) {
                const uint n = n0 + tx + 16u * j;
                if (n < p.N) {
                    y[p.y_offset + m * p.y_stride + p.y_col0 + n] = acc[i][j];
                }
            }
        }
    }
}
