#version 450
// mul_mat_coopmat_<type>_f32[_<tile>]: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k] with
// GL_KHR_cooperative_matrix: f16 A/B fragments, f32 accumulators, 16x16x16, subgroup scope.
// With COOPMAT_EMULATE=1 the same kernel runs without cooperative matrices (see below), so
// the tiling, loaders, double buffering and edge handling are testable on any device.
//
// Tile parameters (specialization constants, as ggml-vulkan's mul_mm: one SPIR-V module per
// weight type serves every tiling): BM x BN output tile per workgroup (rows of x x rows of W),
// BK the K slice per step, WM x WN the output block of one subgroup (of 32 invocations):
// NSG = (BM / WM) * (BN / WN) subgroups, NT = 32 * NSG invocations (constant_id 0, also the
// workgroup size; the host gives it the value that formula makes); subgroup s owns rows
// WM * (s / (BN / WN)) .. +WM-1 and columns WN * (s % (BN / WN)) .. +WN-1 of the tile, i.e.
// (WM / 16) x (WN / 16) accumulator fragments. The host checks the tiling (BM % WM == 0,
// BN % WN == 0, WM, WN, BK multiples of 16, STAGES 1 or 2: ops/mul_mat_kernels.py
// make_coop_variant); the cooperative matrices themselves stay 16 x 16 x 16.
//
// Per step (one barrier): shared memory holds two stages of [x tile BM x BK | W tile BN x BK]
// as f16, row-major with rows padded to SK = BK + 8 halves (every fragment load starts 16-byte
// aligned and the 8 rows a 16-byte-per-row matrix load touches hit distinct bank groups).
// Step s computes from stage s % 2 while the global loads of step s + 1 are already in
// registers-in-flight: each thread issues its x loads (vec4 f32, 4 elements per load) and raw
// weight fetches (8 elements per fetch, coopmat_dq8.glsl) for the next slice, runs the
// step's MMAs (per 16-wide k: WM/16 A loads, WN/16 B loads, (WM/16)(WN/16) MulAdds), then
// converts/dequantizes the registers to f16 into the other stage and hits the barrier.
// STAGES=1 keeps one stage (half the shared memory, e.g. for BK 64): barrier, then commit
// into it, then barrier: two barriers per step.
//
// Output: with FLAG_YVEC (y 16-byte aligned rows) and the whole tile inside M x N, fragments
// are stored straight to y; otherwise each goes through a per-subgroup 16 x 16 f32 staging
// area in shared memory and is written element-wise with bounds checks.
//
// Precision: both operands are rounded to f16 (x and dequantized W; F32/BF16 weights beyond
// the f16 range become inf), products accumulate in f32.
//
// Push constants: as mul_mat (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0,
// y_col0, flags), then ksplit. Workgroups: (ceil(N / BN), ceil(M / BM), splits).
//
// Split K (ksplit > 0, a multiple of BK): workgroup z sums k in [z ksplit, (z + 1) ksplit) and
// writes its partial product at y_offset + z M y_stride (reduce_splitk.comp adds the partials
// into y afterwards). When the output tiles alone are too few workgroups to fill the GPU
// (M = 128, N = 4096: 32 tiles for 132 SMs on the H200) each would otherwise run its whole K
// loop while most of the GPU idles.
//
// Emulation (COOPMAT_EMULATE=1): a "subgroup" is invocations 32 s .. 32 s + 31 of the
// workgroup, whatever the device's subgroup size; an accumulator fragment is 8 floats per
// lane (lane l holds row l / 16 + 2 e, column l % 16 for e = 0..7), an A/B fragment just the
// shared-memory offset it was loaded from; MulAdd computes the lane's 8 outputs from the f16
// shared tiles in f32 (f16 x f16 products are exact in f32). Subgroup barriers become
// workgroup barriers (all fragment loops are uniform).
//
// Routed expert product (MUL_MAT_ID=1, ggml-vulkan's mul_mm with MUL_MAT_ID): mul_mat_id's
// grouped path (vkxsplit/ops/moe.py). Binding 3 holds shaders/moe_group.comp's grouping of
// the T * n_used (token, slot) pairs by expert (counts, offsets, a list of tiles (expert, first
// row) of at most 32 pairs, a row map of pair indices); workgroup (x, y) computes W rows
// BN x .. of tile y's expert against that tile's pairs (BM = 32, the grouping's tile size),
// tiles past the tile count exiting at once. The A (x) rows of the tile are gathered through
// the row map (pair p = t n_used + s reads x row t n_xb + (n_xb > 1 ? s : 0)), the B tile
// is the expert's W rows (expert e's row r is W row e w_rows + w_row0 + r), and every output
// fragment is scattered through the staging area to y row p (y[p y_stride + w_row0 + n]). Its
// push constants are mul_mat_id's (N, K, n_used, n_xb, n_expert, T, w_rows, w_row0, y_stride,
// flags: bit 0 x rows vec4-readable, bit 1 W rows vector-readable); no split K. The bucket of
// ids outside [0, n_expert) gets NaN rows, as mul_mat_id.comp's.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#ifndef COOPMAT_EMULATE
#define COOPMAT_EMULATE 0
#endif
#ifndef MUL_MAT_ID
#define MUL_MAT_ID 0
#endif
#if !COOPMAT_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#endif

#define W_BINDING 0
#include "dequant.glsl"
#include "coopmat_dq8.glsl"

layout(constant_id = 0) const uint NT = 256;    // invocations: 32 * NSG
layout(constant_id = 1) const uint BM = 128;
layout(constant_id = 2) const uint BN = 128;
layout(constant_id = 3) const uint BK = 32;
layout(constant_id = 4) const uint WM = 32;
layout(constant_id = 5) const uint WN = 64;
layout(constant_id = 6) const uint STAGES = 2;  // 2: double-buffered shared tiles; 1: single (two barriers/step)

#define SK (BK + 8u)                // shared row stride in halves
#define SK4 (SK / 4u)               // ... in f16vec4
#define FM (WM / 16u)               // fragments per subgroup block
#define FN (WN / 16u)
#define NSG_N (BN / WN)
#define NSG ((BM / WM) * NSG_N)
#define XQ (BM * BK / 4u)           // x quads per step
#define WU (BN * BK / 8u)           // weight units (8 elements) per step
#define LX ((XQ + NT - 1u) / NT)    // per thread
#define LW ((WU + NT - 1u) / NT)
#define STAGE4 ((BM + BN) * SK4)    // one stage, in f16vec4
#define B4 (BM * SK4)               // W tile offset inside a stage

layout(local_size_x_id = 0) in;

layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer X4 { vec4 x4[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

#if MUL_MAT_ID
layout(std430, binding = 3) readonly buffer Groups { uint grp[]; };
layout(push_constant) uniform Push {
    uint N; uint K; uint n_used; uint n_xb; uint n_expert; uint T; uint w_rows; uint w_row0;
    uint y_stride; uint flags;
} p;
shared uint xrow[BM];   // first element of x of each gathered pair (~0u: no pair)
shared uint yrow[BM];   // first element of y of each gathered pair
uint id_wrow0;          // W row of the tile's expert's first computed row (e w_rows + w_row0)
#else
layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags; uint ksplit;
} p;
#endif

shared f16vec4 sm4[STAGES * STAGE4];
shared float cs[NSG * 256u];

// ------------------------------------------------------------------------------------------
// cooperative-matrix operations (real or emulated)
#if COOPMAT_EMULATE
struct EAcc { float v[8]; };
#define ACC_T EAcc
#define A_T uint
#define B_T uint
#define CM_ZERO(c) c = emu_zero()
#define CM_LOAD_A(f, off4) f = (off4)
#define CM_LOAD_B(f, off4) f = (off4)
#define CM_MAD(c, a, b) c = emu_mad(a, b, c)
#define CM_STORE_Y(c, off) emu_store_y(c, off, p.y_stride)
#define CM_STORE_CS(c, off) emu_store_cs(c, off)
#define CM_SYNC() memoryBarrierShared(); barrier()
#define SG_ID (gl_LocalInvocationID.x >> 5)
#define SG_LANE (gl_LocalInvocationID.x & 31u)

float emu_h(uint h) { return float(sm4[h >> 2][h & 3u]); }
EAcc emu_zero() {
    EAcc c;
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        c.v[e] = 0.0;
    }
    return c;
}
// A row-major at a4 (f16vec4 units), B column-major at b4: A[r][k] = sm[a + r SK + k],
// B[k][c] = sm[b + c SK + k]
EAcc emu_mad(uint a4, uint b4, EAcc c) {
    const uint lane = SG_LANE;
    const uint col = lane & 15u;
    float bc[16];
    [[unroll]] for (uint k = 0u; k < 16u; ++k) {
        bc[k] = emu_h(4u * b4 + col * SK + k);
    }
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        const uint r = (lane >> 4) + 2u * e;
        float s = c.v[e];
        [[unroll]] for (uint k = 0u; k < 16u; ++k) {
            s += emu_h(4u * a4 + r * SK + k) * bc[k];
        }
        c.v[e] = s;
    }
    return c;
}
void emu_store_y(EAcc c, uint off, uint stride) {
    const uint lane = SG_LANE;
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        y[off + ((lane >> 4) + 2u * e) * stride + (lane & 15u)] = c.v[e];
    }
}
void emu_store_cs(EAcc c, uint off) {
    const uint lane = SG_LANE;
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        cs[off + ((lane >> 4) + 2u * e) * 16u + (lane & 15u)] = c.v[e];
    }
}
#else
#define ACC_T coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define A_T coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define B_T coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_ZERO(c) c = ACC_T(0.0)
#define CM_LOAD_A(f, off4) coopMatLoad(f, sm4, off4, SK4, gl_CooperativeMatrixLayoutRowMajor)
#define CM_LOAD_B(f, off4) coopMatLoad(f, sm4, off4, SK4, gl_CooperativeMatrixLayoutColumnMajor)
#define CM_MAD(c, a, b) c = coopMatMulAdd(a, b, c)
#define CM_STORE_Y(c, off) coopMatStore(c, y, off, p.y_stride, gl_CooperativeMatrixLayoutRowMajor)
#define CM_STORE_CS(c, off) coopMatStore(c, cs, off, 16u, gl_CooperativeMatrixLayoutRowMajor)
#define CM_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#endif

// ------------------------------------------------------------------------------------------
// tile loaders: registers for the next slice
vec4 xr[LX];
uvec4 wr[LW][2];

void fetch(uint k0, uint m0, uint n0, uint row_bytes, bool xvec, bool wvec) {
    const uint tid = gl_LocalInvocationID.x;
    [[unroll]] for (uint i = 0u; i < LX; ++i) {
        const uint c = tid + i * NT;
        const uint m = c / (BK / 4u);
        const uint k = k0 + 4u * (c % (BK / 4u));
        vec4 v = vec4(0.0);
#if MUL_MAT_ID
        if ((XQ % NT == 0 || c < XQ) && xrow[m] != ~0u) {
            const uint xi = xrow[m] + k;
#else
        if ((XQ % NT == 0 || c < XQ) && m0 + m < p.M) {
            const uint xi = p.x_offset + (m0 + m) * p.x_stride + k;
#endif
            if (xvec) {
                if (k < p.K) {
                    v = x4[xi >> 2];
                }
            } else {
                [[unroll]] for (uint e = 0u; e < 4u; ++e) {
                    if (k + e < p.K) {
                        v[e] = x[xi + e];
                    }
                }
            }
        }
        xr[i] = v;
    }
    [[unroll]] for (uint i = 0u; i < LW; ++i) {
        const uint c = tid + i * NT;
        const uint n = c / (BK / 8u);
        const uint k = k0 + 8u * (c % (BK / 8u));
        uvec4 r[2];
        r[0] = uvec4(0u);
        r[1] = uvec4(0u);
        if ((WU % NT == 0 || c < WU) && n0 + n < p.N && k < p.K) {
#if MUL_MAT_ID
            const uint rb = (id_wrow0 + n0 + n) * row_bytes;
#else
            const uint rb = (p.w_row0 + n0 + n) * row_bytes;
#endif
#if DQ_FLOAT
            if (wvec && k + 8u <= p.K) {
                t8_fetch(rb, k, r);
            } else {
                [[unroll]] for (uint e = 0u; e < 8u; ++e) {
                    if (k + e < p.K) {
                        t8_fetch1(rb, k, e, r);
                    }
                }
            }
#else
            t8_fetch(rb, k, r);   // K % QK == 0 and 8 | QK: the unit is all in or all out
#endif
        }
        wr[i] = r;
    }
}

// registers -> stage st (f16)
void commit(uint k0, uint st) {
    const uint tid = gl_LocalInvocationID.x;
    const uint base = st * STAGE4;
    [[unroll]] for (uint i = 0u; i < LX; ++i) {
        const uint c = tid + i * NT;
        if (XQ % NT == 0 || c < XQ) {
            sm4[base + (c / (BK / 4u)) * SK4 + (c % (BK / 4u))] = f16vec4(xr[i]);
        }
    }
    [[unroll]] for (uint i = 0u; i < LW; ++i) {
        const uint c = tid + i * NT;
        if (WU % NT == 0 || c < WU) {
            const uint ku = c % (BK / 8u);
            vec4 a, b;
            t8_decode(wr[i], k0 + 8u * ku, a, b);
            const uint o = base + B4 + (c / (BK / 8u)) * SK4 + 2u * ku;
            sm4[o] = f16vec4(a);
            sm4[o + 1u] = f16vec4(b);
        }
    }
}

void main() {
#if MUL_MAT_ID
    // moe_group.comp's layout: counts[ne + 1] | offsets[ne + 1] | n_tiles | tiles[2 * max] | rows[P]
    const uint ne = p.n_expert;
    const uint tile = gl_WorkGroupID.y;
    if (tile >= grp[2u * ne + 2u]) {
        return;
    }
    const uint e = grp[2u * ne + 3u + 2u * tile];
    const uint first = grp[2u * ne + 4u + 2u * tile];
    const uint P = p.T * p.n_used;
    const uint rows0 = 2u * ne + 3u + 2u * (P / BM + min(ne + 1u, P) + 1u);
    for (uint r = gl_LocalInvocationID.x; r < BM; r += NT) {
        if (first + r < grp[e]) {
            const uint pair = grp[rows0 + grp[ne + 1u + e] + first + r];
            const uint t = pair / p.n_used;
            const uint s = pair % p.n_used;
            xrow[r] = (t * p.n_xb + (p.n_xb > 1u ? s : 0u)) * p.K;
            yrow[r] = pair * p.y_stride + p.w_row0;
        } else {
            xrow[r] = ~0u;
            yrow[r] = 0u;
        }
    }
    barrier();
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint m0 = 0u;
    if (e >= ne) {  // the bucket of out-of-range ids: NaN rows
        for (uint c = gl_LocalInvocationID.x; c < BM * BN; c += NT) {
            const uint n = n0 + c % BN;
            if (xrow[c / BN] != ~0u && n < p.N) {
                y[yrow[c / BN] + n] = uintBitsToFloat(0x7fc00000u);
            }
        }
        return;
    }
    id_wrow0 = e * p.w_rows + p.w_row0;
    const uint sg = SG_ID;
    const uint lane = SG_LANE;
    const uint wm = sg / NSG_N;
    const uint wn = sg % NSG_N;
    const uint row_bytes = ROW_BYTES(p.K);
    const bool xvec = (p.flags & 1u) != 0u;
    const bool wvec = (p.flags & 2u) != 0u;
    const uint kbeg = 0u;
    const uint kend = p.K;
#else
    const uint n0 = gl_WorkGroupID.x * BN;
    const uint m0 = gl_WorkGroupID.y * BM;
    const uint sg = SG_ID;
    const uint lane = SG_LANE;
    const uint wm = sg / NSG_N;
    const uint wn = sg % NSG_N;
    const uint row_bytes = ROW_BYTES(p.K);
    const bool xvec = (p.flags & 1u) != 0u;
    const bool wvec = (p.flags & 2u) != 0u;
    const bool yvec = (p.flags & 4u) != 0u;
    const uint kbeg = gl_WorkGroupID.z * p.ksplit;  // ksplit 0: one split, z = 0
    const uint kend = p.ksplit == 0u ? p.K : min(p.K, kbeg + p.ksplit);
    const uint yoff = p.y_offset + gl_WorkGroupID.z * p.M * p.y_stride;
#endif

    ACC_T acc[FM][FN];
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            CM_ZERO(acc[i][j]);
        }
    }

    fetch(kbeg, m0, n0, row_bytes, xvec, wvec);
    commit(kbeg, 0u);
    barrier();

    uint st = 0u;
    for (uint k0 = kbeg; k0 < kend; k0 += BK) {
        const bool more = k0 + BK < kend;
        if (more) {
            fetch(k0 + BK, m0, n0, row_bytes, xvec, wvec);
        }
        const uint a0 = st * STAGE4 + wm * WM * SK4;
        const uint b0 = st * STAGE4 + B4 + wn * WN * SK4;
        [[unroll]] for (uint kk = 0u; kk < BK / 4u; kk += 4u) {   // 16 halves = 4 f16vec4
            A_T a[FM];
            B_T b[FN];
            [[unroll]] for (uint i = 0u; i < FM; ++i) {
                CM_LOAD_A(a[i], a0 + 16u * i * SK4 + kk);
            }
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                CM_LOAD_B(b[j], b0 + 16u * j * SK4 + kk);
            }
            [[unroll]] for (uint i = 0u; i < FM; ++i) {
                [[unroll]] for (uint j = 0u; j < FN; ++j) {
                    CM_MAD(acc[i][j], a[i], b[j]);
                }
            }
        }
        if (more) {
            if (STAGES == 1u) {
                barrier();                  // everyone is done reading the stage
                commit(k0 + BK, 0u);
            } else {
                commit(k0 + BK, st ^ 1u);
            }
        }
        barrier();
        if (STAGES == 2u) {
            st ^= 1u;
        }
    }

    const uint mb0 = m0 + wm * WM;
    const uint nb0 = n0 + wn * WN;
#if MUL_MAT_ID
    // each fragment through this subgroup's 16x16 staging area, scattered to its pairs' rows
    const uint cbase = sg * 256u;
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            CM_STORE_CS(acc[i][j], cbase);
            CM_SYNC();
            const uint mb = mb0 + 16u * i;
            const uint nb = nb0 + 16u * j;
            [[unroll]] for (uint c = lane; c < 256u; c += 32u) {
                const uint m = mb + c / 16u;
                const uint n = nb + c % 16u;
                if (xrow[m] != ~0u && n < p.N) {
                    y[yrow[m] + n] = cs[cbase + c];
                }
            }
            CM_SYNC();
        }
    }
#else
    if (yvec && m0 + BM <= p.M && n0 + BN <= p.N) {
        // interior tile: straight to y
        [[unroll]] for (uint i = 0u; i < FM; ++i) {
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                CM_STORE_Y(acc[i][j], yoff + (mb0 + 16u * i) * p.y_stride + p.y_col0 + nb0 + 16u * j);
            }
        }
        return;
    }
    // edge tile: each fragment through this subgroup's 16x16 staging area, bounds-checked
    const uint cbase = sg * 256u;
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            CM_STORE_CS(acc[i][j], cbase);
            CM_SYNC();
            const uint mb = mb0 + 16u * i;
            const uint nb = nb0 + 16u * j;
            [[unroll]] for (uint e = lane; e < 256u; e += 32u) {
                const uint m = mb + e / 16u;
                const uint n = nb + e % 16u;
                if (m < p.M && n < p.N) {
                    y[yoff + m * p.y_stride + p.y_col0 + n] = cs[cbase + e];
                }
            }
            CM_SYNC();
        }
    }
#endif
}
