#version 450
// mul_mat_vec_<q4_0|q8_0>_f32_m<1|4>_wide_*: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k] for
// M <= MAXM columns of x, Q4_0 / Q8_0 weights whose rows are 16-byte aligned: K % 256 == 0
// (then a row is a whole number of 8-block groups, 144 bytes = 9 uvec4 for Q4_0, 272 bytes =
// 17 uvec4 for Q8_0) and the weight binding 16-aligned (the Python side checks both).
//
// Layout: a workgroup of WG threads computes NR rows; thread tid works on row tid % NR as
// lane tid / NR of that row's team of L = WG / NR threads, so consecutive threads are
// different rows at the same K range: lanes of a warp that read x read the same addresses
// (broadcast, NR lanes per address), while each lane streams its own row.
// A thread takes 8-block groups g = lane, lane + L, ... of its row (UNR groups per loop
// iteration): it first loads the whole group with GW (9 or 17) aligned uvec4 loads
// (UNR * GW * 16 bytes in flight per thread before any use), then decodes from registers:
// block b of the group starts at byte QBYTES * b (18 b or 34 b), so even blocks have the f16
// scale in the low half of a word and their quants 2 bytes past a word boundary (one funnel
// shift of two words per quant word), odd blocks the scale in a high half and word-aligned
// quants. Quants become exact floats with the 2^23 trick (one OR per byte and
// one FADD that also removes the -8 / +128 offset), then one FMA per element; the block
// scale multiplies the block's dot product once.
//
// x: XSH 0 reads x pieces (vec4, or scalar when x rows are not vec4-aligned) straight from
// global memory (L1-resident; broadcast across the NR rows of a warp); XSH 1 stages each
// chunk of UNR * L groups of x (f32) in shared memory once per workgroup (two barriers per
// chunk; M = 1 only).
//
// Partial sums are reduced through shared memory only (no subgroup operations: rows are
// interleaved across lanes, and any subgroup size works): thread (row, column) adds its
// row's L lane sums.
//
// Defines: WTYPE (Q4_0 or Q8_0), WG, NR, UNR, MAXM, XSH.
// Push constants as mul_mat_vec.comp (flags bit 0: x rows vec4-aligned).
// Workgroups: ceil(N / NR) folded into (x, y) as x + y * gl_NumWorkGroups.x.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require

#define W_BINDING 0
#include "dequant.glsl"

#if WTYPE == WT_Q4_0
#define GW 9u    // uvec4 per group of 8 blocks (144 bytes)
#elif WTYPE == WT_Q8_0
#define GW 17u   // 272 bytes
#else
#error "mul_mat_vec_wide: Q4_0 and Q8_0 only"
#endif
#define GQ (4u * GW)  // words per group

#ifndef WG
#define WG 128
#endif
#ifndef NR
#define NR 4
#endif
#ifndef UNR
#define UNR 1
#endif
#ifndef MAXM
#define MAXM 1
#endif
#ifndef XSH
#define XSH 0
#endif
#if WG % NR != 0
#error "WG must be a multiple of NR"
#endif
#define L (WG / NR)  // threads per row
#if NR * MAXM > WG
#error "the final reduction needs a thread per (row, column): NR * MAXM <= WG"
#endif
#if XSH && MAXM != 1
#error "x staging in shared memory: M = 1 only"
#endif

layout(local_size_x = WG) in;

layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer X4 { vec4 x4[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;

shared float red[MAXM][WG];
#if XSH
shared vec4 xs[UNR * L * 64];  // one chunk of x: UNR * L groups of 256 elements
uint xc0;                      // first element of the staged chunk
#endif

uint xb[MAXM];       // first element of each column of x (columns >= M repeat M - 1)
float acc[MAXM];

vec4 load_x4(uint i, const bool xvec) {
    if (xvec) {
        return x4[i >> 2];
    }
    return vec4(x[i], x[i + 1u], x[i + 2u], x[i + 3u]);
}

// elements e..e+3 of column m of x (e: element index in the row, e % 4 == 0)
vec4 xpiece(uint m, uint e, const bool xvec) {
#if XSH
    return xs[(e - xc0) >> 2];
#else
    return load_x4(xb[m] + e, xvec);
#endif
}

float fdot(vec4 a, vec4 b, float t) {
    return fma(a.w, b.w, fma(a.z, b.z, fma(a.y, b.y, fma(a.x, b.x, t))));
}

// bytes 2..5 of the 8 bytes lo | hi << 32 (a quant word of an even block)
uint funnel16(uint lo, uint hi) {
    return (lo >> 16) | (hi << 16);
}

// one group of 8 blocks (words q, from the group's first byte) at row element e0
void group(const uvec4 q4[GW], uint e0, const bool xvec) {
    uint w[GQ];
    [[unroll]] for (uint i = 0u; i < GW; ++i) {
        w[4u * i] = q4[i].x;
        w[4u * i + 1u] = q4[i].y;
        w[4u * i + 2u] = q4[i].z;
        w[4u * i + 3u] = q4[i].w;
    }
    [[unroll]] for (uint b = 0u; b < 8u; ++b) {
        const bool odd = (b & 1u) != 0u;
        const uint eb = e0 + 32u * b;
#if WTYPE == WT_Q4_0
        // block b at byte 18 b: word 9 (b / 2) (even b), or its high half of word 9 (b / 2) + 4
        const uint w0 = 9u * (b >> 1) + (odd ? 4u : 0u);
        const vec2 dd = unpackHalf2x16(w[w0]);
        const float d = odd ? dd.y : dd.x;
        vec4 cl[4];
        vec4 ch[4];
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            const uint qq = odd ? w[w0 + 1u + j] : funnel16(w[w0 + j], w[w0 + j + 1u]);
            cl[j] = bytes_f(qq & 0x0F0F0F0Fu, 8.0);          // elements 4j..4j+3
            ch[j] = bytes_f((qq >> 4) & 0x0F0F0F0Fu, 8.0);   // elements 16+4j..
        }
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            float tl = 0.0;
            float th = 0.0;
            [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                tl = fdot(cl[j], xpiece(m, eb + 4u * j, xvec), tl);
                th = fdot(ch[j], xpiece(m, eb + 16u + 4u * j, xvec), th);
            }
            acc[m] = fma(d, tl + th, acc[m]);
        }
#else
        // block b at byte 34 b: word 17 (b / 2) (even b), or the high half of word 17 (b / 2) + 8
        const uint w0 = 17u * (b >> 1) + (odd ? 8u : 0u);
        const vec2 dd = unpackHalf2x16(w[w0]);
        const float d = odd ? dd.y : dd.x;
        vec4 c[8];
        [[unroll]] for (uint j = 0u; j < 8u; ++j) {
            const uint qq = odd ? w[w0 + 1u + j] : funnel16(w[w0 + j], w[w0 + j + 1u]);
            c[j] = bytes_f(qq ^ 0x80808080u, 128.0);         // elements 4j..4j+3, signed
        }
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            float tl = 0.0;
            float th = 0.0;
            [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                tl = fdot(c[j], xpiece(m, eb + 4u * j, xvec), tl);
                th = fdot(c[j + 4u], xpiece(m, eb + 16u + 4u * j, xvec), th);
            }
            acc[m] = fma(d, tl + th, acc[m]);
        }
#endif
    }
}

void main() {
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    const uint row0 = wg * NR;
    if (row0 >= p.N) {
        return;  // whole workgroup: the padding of the folded grid
    }
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid % NR;   // this thread's row (of the workgroup's NR)
    const uint lane = tid / NR;  // lane in the row's team of L
    const uint ng = p.K / 256u;  // groups per row
    // first uvec4 of the row (rows past N: computed, not written)
    const uint gb = (p.w_row0 + min(row0 + r, p.N - 1u)) * (ng * GW);
    const bool xvec = (p.flags & 1u) != 0u;

    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        xb[m] = p.x_offset + min(m, p.M - 1u) * p.x_stride;
        acc[m] = 0.0;
    }

#if XSH
    // chunks of UNR * L groups, all threads in step (uniform loop, barriers)
    for (uint c0 = 0u; c0 < ng; c0 += UNR * L) {
        uvec4 q[UNR][GW];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = min(c0 + lane + u * L, ng - 1u);
            [[unroll]] for (uint i = 0u; i < GW; ++i) {
                q[u][i] = w_u128[gb + g * GW + i];
            }
        }
        barrier();  // the previous chunk is consumed
        const uint n4 = min(UNR * L, ng - c0) * 64u;
        for (uint i = tid; i < n4; i += WG) {
            xs[i] = load_x4(xb[0] + 256u * c0 + 4u * i, xvec);
        }
        xc0 = 256u * c0;
        barrier();
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = c0 + lane + u * L;
            if (g < ng) {
                group(q[u], 256u * g, xvec);
            }
        }
    }
#else
    for (uint g0 = lane; g0 < ng; g0 += UNR * L) {
        uvec4 q[UNR][GW];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = min(g0 + u * L, ng - 1u);  // past the row: a valid address, unused
            [[unroll]] for (uint i = 0u; i < GW; ++i) {
                q[u][i] = w_u128[gb + g * GW + i];
            }
        }
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < ng) {
                group(q[u], 256u * g, xvec);
            }
        }
    }
#endif

    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        red[m][tid] = acc[m];
    }
    barrier();
    if (tid < NR * MAXM) {
        const uint rr = tid % NR;
        const uint m = tid / NR;
        if (m < p.M && row0 + rr < p.N) {
            float s = 0.0;
            [[unroll]] for (uint i = 0u; i < L; ++i) {
                s += red[m][i * NR + rr];
            }
            y[p.y_offset + m * p.y_stride + p.y_col0 + row0 + rr] = s;
        }
    }
}
