#version 450
// mul_mat_id_<type>_f32: the routed expert product (ggml's mul_mat_id).
//   y[t, s, r0 + n] = sum_k W[ids[t, s], r0 + n, k] * x[t, n_xb > 1 ? s : 0, k]   (0 <= n < N)
// W is the stored (n_expert, w_rows, K) tensor in its ggml type (expert e's row r starts at
// byte (e * w_rows + r) * ROW_BYTES(K)); x is f32 (T, n_xb, K); y is f32 (T, n_used, y_stride)
// (pair p = t * n_used + s is row p of y). Weights are dequantized with dq4 / dq1
// (dequant.glsl), so every type that file declares works here. Two paths in one module
// (flags bit 1), 256 threads each:
//
// decode (bit 1 set; binding 2 = the ids): a workgroup computes VNR = 8 consecutive output
// rows of one pair, VL = 32 lanes per row taking the mat-vec units of dequant.glsl (dqx_codes;
// float types: quads) u = lane, lane + 32, ..., then a shared-memory tree reduction per row
// (grid: ceil(N / 8) x pairs). At T = 1 this reads only the n_used selected experts' rows,
// once each.
//
// prefill (bit 1 clear; binding 2 = moe_group.comp's grouping: per expert a count, an offset
// into a row map of pair indices, and a list of tiles (expert, first row), at most BM rows
// each): a workgroup computes one BN x BM tile of y: BN rows of one expert's matrix against
// up to BM of the pairs routed to that expert, gathered through the row map. Each expert's
// rows are read once per BM pairs routed to it (not once per token); the grid has
// ceil(N / BN) x (P / BM + min(n_expert + 1, P) + 1) workgroups (P = T * n_used), of which
// those past the tile count exit at once.
//
// An id outside [0, n_expert) (only a corrupt ids buffer: moe_topk writes none) gives a row
// of NaN, so that the model reports non-finite logits instead of a silently wrong answer.
//
// Push constants: N (rows computed per expert), K, n_used, n_xb, n_expert, T, w_rows (rows
// per expert in W), w_row0 (first row, r0), y_stride (elements per y row), flags (bit 0:
// float W rows vec4-readable, i.e. K % 4 == 0; bit 1: the decode path).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

layout(std430, binding = 1) readonly buffer X { float x[]; };
// binding 2: the ids (decode) or moe_group.comp's grouping (prefill)
layout(std430, binding = 2) readonly buffer Ids { int ids[]; };
layout(std430, binding = 2) readonly buffer Groups { uint grp[]; };
layout(std430, binding = 3) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint N; uint K; uint n_used; uint n_xb; uint n_expert; uint T; uint w_rows; uint w_row0;
    uint y_stride; uint flags;
} p;

#define NAN uintBitsToFloat(0x7fc00000u)

layout(local_size_x = 256) in;
shared float red[256];

vec4 w4(uint rb, uint k) {
#if DQ_FLOAT
    if ((p.flags & 1u) == 0u) {
        vec4 v = vec4(0.0);
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            if (k + i < p.K) {
                v[i] = dq1(rb, k + i);
            }
        }
        return v;
    }
    if (k >= p.K) {
        return vec4(0.0);
    }
#endif
    return dq4(rb, k);  // quantized: K % QK == 0 and the tiles never pass K
}

vec4 x4(uint xb, uint k) {
    vec4 v = vec4(0.0);
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
        if (k + i < p.K) {
            v[i] = x[xb + k + i];
        }
    }
    return v;
}

// -------------------------------------------------------------------------------------------
// decode (flags bit 1): a workgroup computes VNR consecutive rows of one pair, VL lanes per row
#define VNR 8u
#define VL 32u

#if !DQ_FLOAT
// one mat-vec unit of dequant.glsl (dqx_codes: DQX_U elements read with wide loads, exact
// codes, the block scales factored out of each scale group's dot product) against x
#define RPG (DQX_NV / DQX_G)
float unit_dot(uint rb, uint u, uint xb) {
    vec4 c[DQX_NV];
    float sc[DQX_G];
    float mn[DQX_G];
    dqx_codes(rb, u, c, sc, mn);
    float acc = 0.0;
    [[unroll]] for (uint g = 0u; g < DQX_G; ++g) {
        float t = 0.0;
        vec4 xs4 = vec4(0.0);
        [[unroll]] for (uint j = g * RPG; j < (g + 1u) * RPG; ++j) {
            const uint k = xb + dqx_run(u, j);
            const vec4 xv = vec4(x[k], x[k + 1u], x[k + 2u], x[k + 3u]);
            t += dot(c[j], xv);
            xs4 += xv;
        }
#if DQX_MIN
        acc += fma(sc[g], t, mn[g] * dot(xs4, vec4(1.0)));
#else
        acc = fma(sc[g], t, acc);
#endif
    }
    return acc;
}
#endif

void vec_main() {
    const uint pair = gl_WorkGroupID.y;
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid / VL;
    const uint lane = tid % VL;
    const uint row = gl_WorkGroupID.x * VNR + r;
    const uint t = pair / p.n_used;
    const uint s = pair % p.n_used;
    const int e = ids[pair];
    const uint yb = pair * p.y_stride + p.w_row0;
    if (e < 0 || uint(e) >= p.n_expert) {
        if (lane == 0u && row < p.N) {
            y[yb + row] = NAN;
        }
        return;  // (the whole workgroup: e is the same for all)
    }
    const uint xb = (t * p.n_xb + (p.n_xb > 1u ? s : 0u)) * p.K;
    const uint rb = (uint(e) * p.w_rows + p.w_row0 + min(row, p.N - 1u)) * ROW_BYTES(p.K);
    float acc = 0.0;
#if DQ_FLOAT
    for (uint k = 4u * lane; k < p.K; k += 4u * VL) {
        acc += dot(w4(rb, k), x4(xb, k));
    }
#else
    for (uint u = lane; u < p.K / DQX_U; u += VL) {
        acc += unit_dot(rb, u, xb);
    }
#endif
    red[tid] = acc;
    barrier();
    [[unroll]] for (uint h = VL / 2u; h > 0u; h >>= 1) {
        if (lane < h) {
            red[tid] += red[tid + h];
        }
        barrier();
    }
    if (lane == 0u && row < p.N) {
        y[yb + row] = red[tid];
    }
}

// -------------------------------------------------------------------------------------------
// prefill: one BN x BM tile of y, the pairs of one tile of moe_group.comp's list
#define BM 32
#define BN 64
#define BK 32
#define TM 2
#define TN 4

shared float xs[BK][BM];
shared float ws[BK][BN];
shared uint xrow[BM];   // first element of x of each gathered pair (or ~0u: no pair)
shared uint yrow[BM];   // first element of y of each gathered pair

void tiled_main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint ne = p.n_expert;
    // moe_group.comp's layout: counts[ne + 1] | offsets[ne + 1] | n_tiles | tiles[2 * max] | rows[P]
    const uint n_tiles = grp[2u * ne + 2u];
    const uint tile = gl_WorkGroupID.y;
    if (tile >= n_tiles) {
        return;
    }
    const uint e = grp[2u * ne + 3u + 2u * tile];
    const uint first = grp[2u * ne + 4u + 2u * tile];
    const uint cnt = grp[e];
    const uint base = grp[ne + 1u + e];
    const uint rows0 = 2u * ne + 3u + 2u * (p.T * p.n_used / BM + min(ne + 1u, p.T * p.n_used) + 1u);
    const uint n0 = gl_WorkGroupID.x * BN;
    if (tid < BM) {
        if (first + tid < cnt) {
            const uint pair = grp[rows0 + base + first + tid];
            const uint t = pair / p.n_used;
            const uint s = pair % p.n_used;
            xrow[tid] = (t * p.n_xb + (p.n_xb > 1u ? s : 0u)) * p.K;
            yrow[tid] = pair * p.y_stride;
        } else {
            xrow[tid] = ~0u;
            yrow[tid] = 0u;
        }
    }
    barrier();
    if (e >= ne) {  // the bucket of out-of-range ids: NaN rows
        for (uint c = tid; c < BM * BN; c += 256u) {
            const uint m = c / BN;
            const uint n = n0 + c % BN;
            if (xrow[m] != ~0u && n < p.N) {
                y[yrow[m] + p.w_row0 + n] = NAN;
            }
        }
        return;
    }
    const uint tx = tid % 16u;
    const uint ty = tid / 16u;
    const uint row_bytes = ROW_BYTES(p.K);
    const uint wb = e * p.w_rows + p.w_row0;

    float acc[TM][TN];
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        [[unroll]] for (uint j = 0u; j < TN; ++j) {
            acc[i][j] = 0.0;
        }
    }
    for (uint k0 = 0u; k0 < p.K; k0 += BK) {
        [[unroll]] for (uint c = tid; c < BN * BK / 4u; c += 256u) {
            const uint n = c % BN;
            const uint kq = c / BN;
            vec4 v = vec4(0.0);
            if (n0 + n < p.N) {
                v = w4((wb + n0 + n) * row_bytes, k0 + 4u * kq);
            }
            ws[4u * kq][n] = v.x;
            ws[4u * kq + 1u][n] = v.y;
            ws[4u * kq + 2u][n] = v.z;
            ws[4u * kq + 3u][n] = v.w;
        }
        [[unroll]] for (uint c = tid; c < BM * BK / 4u; c += 256u) {
            const uint m = c % BM;
            const uint kq = c / BM;
            vec4 v = vec4(0.0);
            if (xrow[m] != ~0u) {
                v = x4(xrow[m], k0 + 4u * kq);
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
        const uint m = ty + 16u * i;
        if (xrow[m] != ~0u) {
            [[unroll]] for (uint j = 0u; j < TN; ++j) {
                const uint n = n0 + tx + 16u * j;
                if (n < p.N) {
                    y[yrow[m] + p.w_row0 + n] = acc[i][j];
                }
            }
        }
    }
}
void main() {
    if ((p.flags & 2u) != 0u) {
        vec_main();
    } else {
        tiled_main();
    }
}
