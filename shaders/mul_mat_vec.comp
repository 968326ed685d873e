#version 450
// mul_mat_vec_<type>_f32: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k] for M <= 8 columns of x
// (decode). A workgroup computes NR consecutive output rows for all M columns: its threads
// split K into mat-vec units (dequant.glsl), decode each unit of each row once into exact
// integer codes in registers and use them for every column, with the block scales factored
// out of each scale group's dot product (sum_g sc_g * (c . x) + mn_g * sum(x)); partial
// sums are reduced with subgroupAdd and then across subgroups in shared memory.
// Defines: WTYPE, WG (threads), NR (rows per workgroup), MAXM (most columns handled: the
// variants with MAXM 1, 2, 4 use fewer registers than the 8-column one).
//
// Push constants (elements, not bytes): M, N, K, x_stride, y_stride, x_offset, y_offset,
// w_row0 (first W row), y_col0 (first y column), flags (bit 0: x rows are vec4-aligned;
// bit 1: unit path allowed, i.e. quantized or K % 8 == 0 float rows).
// Workgroups: ceil(N / NR) folded into (x, y) as x + y * gl_NumWorkGroups.x.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

#ifndef WG
#define WG 64
#endif
#ifndef NR
#define NR 2
#endif
#ifndef MAXM
#define MAXM 8  // columns of x handled per pass
#endif
#define RPG (DQ_NV / DQ_G)  // runs per scale group

layout(local_size_x = WG) in;

layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer X4 { vec4 x4[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

// one slot per (row, column, subgroup): sized for the worst case of 1-wide subgroups
shared float red[NR * MAXM][WG];

vec4 load_x4(uint i) {
    if ((p.flags & 1u) != 0u) {
        return x4[i >> 2];
    }
    return vec4(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);
}

void main() {
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    const uint row0 = wg * NR;
    if (row0 >= p.N) {
        return;  // whole workgroup: the padding of the folded grid
    }
    const uint tid = gl_LocalInvocationID.x;
    const uint row_bytes = ROW_BYTES(p.K);

    uint rb[NR];
    [[unroll]] for (uint r = 0u; r < NR; ++r) {
        rb[r] = (p.w_row0 + min(row0 + r, p.N - 1u)) * row_bytes;  // rows past N: computed, not written
    }
    uint xb[MAXM];
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        xb[m] = p.x_offset + m * p.x_stride;
    }
    float acc[NR][MAXM];
    [[unroll]] for (uint r = 0u; r < NR; ++r) {
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            acc[r][m] = 0.0;
        }
    }

    if ((p.flags & 2u) != 0u) {
        const uint nu = p.K / DQ_U;
        for (uint u = tid; u < nu; u += WG) {
            vec4 c[NR][DQ_NV];
            float sc[NR][DQ_G];
            float mn[NR][DQ_G];
            [[unroll]] for (uint r = 0u; r < NR; ++r) {
                dq_codes(rb[r], u, c[r], sc[r], mn[r]);
            }
            [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
                if (m < p.M) {
                    vec4 xv[DQ_NV];
                    [[unroll]] for (uint j = 0u; j < DQ_NV; ++j) {
                        xv[j] = load_x4(xb[m] + dq_run(u, j));
                    }
                    [[unroll]] for (uint g = 0u; g < DQ_G; ++g) {
#if DQ_MIN
                        float xs = 0.0;
                        [[unroll]] for (uint j = g * RPG; j < (g + 1u) * RPG; ++j) {
                            xs += dot(xv[j], vec4(1.0));
                        }
#endif
                        [[unroll]] for (uint r = 0u; r < NR; ++r) {
                            float t = 0.0;
                            [[unroll]] for (uint j = g * RPG; j < (g + 1u) * RPG; ++j) {
                                t += dot(c[r][j], xv[j]);
                            }
#if DQ_MIN
                            acc[r][m] += fma(sc[r][g], t, mn[r][g] * xs);
#else
                            acc[r][m] += sc[r][g] * t;
#endif
                        }
                    }
                }
            }
        }
    }
#if DQ_FLOAT
    else {
        // float rows of any length / alignment: one element at a time
        for (uint k = tid; k < p.K; k += WG) {
            float w[NR];
            [[unroll]] for (uint r = 0u; r < NR; ++r) {
                w[r] = dq1(rb[r], k);
            }
            [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
                if (m < p.M) {
                    const float xv = x[xb[m] + k];
                    [[unroll]] for (uint r = 0u; r < NR; ++r) {
                        acc[r][m] += w[r] * xv;
                    }
                }
            }
        }
    }
#endif

    [[unroll]] for (uint r = 0u; r < NR; ++r) {
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            if (m < p.M) {
                const float s = subgroupAdd(acc[r][m]);
                if (subgroupElect()) {
                    red[r * MAXM + m][gl_SubgroupID] = s;
                }
            }
        }
    }
    barrier();
    if (tid < NR * MAXM) {
        const uint r = tid / MAXM;
        const uint m = tid % MAXM;
        if (m < p.M && row0 + r < p.N) {
            float s = 0.0;
            for (uint g = 0u; g < gl_NumSubgroups; ++g) {
                s += red[tid][g];
            }
            y[p.y_offset + m * p.y_stride + p.y_col0 + row0 + r] = s;
        }
    }
}
