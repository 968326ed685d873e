#version 450
// mul_mat_vec_<type>_f32: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k] for M <= 8 columns of x
// (decode; memory-bandwidth bound).
//
// A workgroup of WG threads computes NR consecutive output rows for all M columns. K is cut
// into mat-vec units of DQX_U elements (dequant.glsl, dqx_codes: a unit is one lane's share
// of a block, DQX_L lanes per block, so consecutive threads read consecutive bytes of a row
// and consecutive pieces of x). Thread tid takes units tid, tid + WG, ...: each main-loop
// iteration handles UNR units of all NR rows with no branches, so the compiler can issue
// all NR * UNR units' weight loads (plus the x loads) before the first use (the loads in
// flight per thread: NR * UNR * the unit's bytes); a remainder loop takes the last units.
// Each unit is decoded once into exact integer codes and used for every column, with the
// block scales factored out of each scale group's dot product
// (sum_g sc_g * (c . x) + mn_g * sum(x)); each x piece is loaded once per workgroup row
// group and used for all NR rows. Columns m >= M repeat column M - 1 (no branches in the
// loop) and are not written. Partial sums are reduced with subgroupAdd and then across
// subgroups in shared memory (any subgroup size).
//
// Defines (one SPIR-V module each): WTYPE, DQX_L (lanes per block, see dequant.glsl).
// Specialization constants (the shape; one module serves every shape of its type):
// WG (threads; constant_id 0, also the workgroup size), NR (rows per workgroup), UNR (units
// per thread per iteration), MAXM (most columns handled: fewer columns, fewer registers).
// The final reduction needs a thread per (row, column): NR * MAXM <= WG (the variant maker,
// vkxsplit.ops.mul_mat_kernels.make_vec_variant, refuses other shapes).
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

layout(constant_id = 0) const uint WG = 128;
layout(constant_id = 1) const uint NR = 2;
layout(constant_id = 2) const uint UNR = 1;
layout(constant_id = 3) const uint MAXM = 8;  // columns of x handled per pass
#define RPG (DQX_NV / DQX_G)  // runs per scale group

layout(local_size_x_id = 0) in;

layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer X4 { vec4 x4[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

// one slot per (row, column, subgroup): sized for the worst case of 1-wide subgroups
shared float red[NR * MAXM][WG];

uint rb[NR];          // first byte of each row
uint xb[MAXM];        // first element of each column of x (columns >= M repeat M - 1)
float acc[NR][MAXM];

vec4 load_x4(uint i, const bool xvec) {
    if (xvec) {
        return x4[i >> 2];
    }
    return vec4(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);
}

// one unit u of all NR rows, for all MAXM columns
void unit(uint u, const bool xvec) {
    vec4 c[NR][DQX_NV];
    float sc[NR][DQX_G];
    float mn[NR][DQX_G];
    [[unroll]] for (uint r = 0u; r < NR; ++r) {
        dqx_codes(rb[r], u, c[r], sc[r], mn[r]);
    }
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        vec4 xv[DQX_NV];
        [[unroll]] for (uint j = 0u; j < DQX_NV; ++j) {
            xv[j] = load_x4(xb[m] + dqx_run(u, j), xvec);
        }
        [[unroll]] for (uint g = 0u; g < DQX_G; ++g) {
#if DQX_MIN
            vec4 xs4 = xv[g * RPG];
            [[unroll]] for (uint j = g * RPG + 1u; j < (g + 1u) * RPG; ++j) {
                xs4 += xv[j];
            }
            const float xs = dot(xs4, vec4(1.0));
#endif
            [[unroll]] for (uint r = 0u; r < NR; ++r) {
                float t = dot(c[r][g * RPG], xv[g * RPG]);
                [[unroll]] for (uint j = g * RPG + 1u; j < (g + 1u) * RPG; ++j) {
                    t += dot(c[r][j], xv[j]);
                }
#if DQX_MIN
                acc[r][m] += fma(sc[r][g], t, mn[r][g] * xs);
#else
                acc[r][m] = fma(sc[r][g], t, acc[r][m]);
#endif
            }
        }
    }
}

// thread tid's units: UNR at a time (branch-free bodies), then the remainder one at a time
void units(uint tid, const bool xvec) {
    const uint nu = p.K / DQX_U;
    uint u = tid;
    for (; u + (UNR - 1u) * WG < nu; u += UNR * WG) {
        [[unroll]] for (uint i = 0u; i < UNR; ++i) {
            unit(u + i * WG, xvec);
        }
    }
    if (UNR > 1u) {  // a constant once specialized
        for (; u < nu; u += WG) {
            unit(u, xvec);
        }
    }
}

void main() {
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    const uint row0 = wg * NR;
    if (row0 >= p.N) {
        return;  // whole workgroup: the padding of the folded grid
    }
    const uint tid = gl_LocalInvocationID.x;
    const uint row_bytes = ROW_BYTES(p.K);

    [[unroll]] for (uint r = 0u; r < NR; ++r) {
        rb[r] = (p.w_row0 + min(row0 + r, p.N - 1u)) * row_bytes;  // rows past N: computed, not written
    }
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        xb[m] = p.x_offset + min(m, p.M - 1u) * p.x_stride;
    }
    [[unroll]] for (uint r = 0u; r < NR; ++r) {
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            acc[r][m] = 0.0;
        }
    }

    if ((p.flags & 2u) != 0u) {
        if ((p.flags & 1u) != 0u) {
            units(tid, true);
        } else {
            units(tid, false);
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
                const float xv = x[xb[m] + k];
                [[unroll]] for (uint r = 0u; r < NR; ++r) {
                    acc[r][m] = fma(w[r], xv, acc[r][m]);
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
