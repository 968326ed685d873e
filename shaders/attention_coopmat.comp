#version 450
// attn_cm_f16_f32_d<HD>: causal grouped-query attention over an f16 KV cache for prefill-sized
// batches, flash-attention style, with the two products of each block on cooperative matrices
// (GL_KHR_cooperative_matrix: f16 A/B fragments, f32 accumulators, 16x16x16, subgroup scope).
// Same bindings, push constants, grid and results (to f16 rounding of the operands) as
// attention.comp's n_splits == 1 path, which ops/attention.py takes for small batches, decode
// and any head_dim, cache offset or device this kernel does not cover.
//
//   q   f32 [n_tokens, n_heads, head_dim] (token stride q_stride, heads contiguous)
//   K,V f16 [n_ctx, n_kv, head_dim] (the cache; k_off and v_off multiples of 8 halves)
//   pos int32: pos0 = pos[pos_off]; token t (position pos0 + t) sees cache positions
//       0 .. pos0 + t, within the sliding window swa when swa > 0
//   out f32 [n_tokens, n_heads, head_dim] (token stride o_stride); `part` is not used
//
// Workgroup (row block y, kv head g): BR = 64 query rows, the (token, head) pairs of the heads
// sharing kv head g (row rr: token rr / grp, head g grp + rr % grp, grp = n_heads / n_kv), so
// one K/V block in shared memory serves every head of the group. Four subgroups of 32
// invocations; subgroup s owns rows 16 s .. 16 s + 15. Per block of BC cache positions:
//   1. K and V of the block go from registers (fetched one block ahead) to shared f16 tiles;
//   2. S = Q K^T: each subgroup multiplies its 16 x HD queries (A fragments kept in registers
//      for the whole loop) by the K tile read as column-major B fragments, HD / 16 x BC / 16
//      MMAs, and stores S (f32) to its part of shared memory;
//   3. online softmax: two invocations per row, BC / 2 scores each (masked: past the row's
//      position, outside its window, past the cache), the row's new maximum and sum through
//      shared memory, probabilities P as f16 into a shared tile, and the rescale factor alpha
//      of the row's running output;
//   4. O = alpha O + P V, 16 head dims at a time: the chunk's MMAs into a zeroed accumulator,
//      stored to the subgroup's scratch and added into the output each invocation keeps in
//      registers (element e of chunk f: row lane / 16 + 2 e, dim 16 f + lane % 16), so the
//      per-row rescale needs no per-element access to an accumulator.
// Only the tiles' loads and overwrites need the whole workgroup (two barriers a block); the
// softmax and the output update are each subgroup's own (subgroup barriers).
//
// Shared memory (HD 128, BC 32): the Q tile, then (after the subgroups have read their
// fragments) the K and V tiles in the same place, 17 KiB; S, or a P V chunk, 8 KiB; P, 5 KiB.
//
// Precision: q * scale (clamped to f16's range), K, V and P rounded to f16 (the row sums add
// the rounded P); products accumulate in f32, the softmax in f32.
//
// Emulation (COOPMAT_EMULATE=1): the same kernel without cooperative matrices, any subgroup
// size, so lavapipe tests its logic: a "subgroup" is invocations 32 s .. 32 s + 31, an
// accumulator 8 floats per lane in the layout of the output registers above, an A/B fragment
// the shared-memory offset (in halves) it was loaded from, subgroup barriers workgroup
// barriers (every loop is uniform). The Q tile then keeps its own place (its fragments are
// offsets into it), and the tiles' rows are not padded (so HD 64 with BC 32 fits lavapipe's
// 32 KiB).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
#ifndef COOPMAT_EMULATE
#define COOPMAT_EMULATE 0
#endif
#if !COOPMAT_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#endif

layout(constant_id = 0) const uint HD = 128;  // head_dim: a multiple of 16, HD / 8 * BC a multiple of NT
layout(constant_id = 1) const uint BC = 32;   // cache positions per block: a multiple of 16

#define NT 128u
#define NSG 4u
#define BR 64u                  // query rows per workgroup: 16 per subgroup
#if COOPMAT_EMULATE
#define SQ (HD / 4u)            // row stride (f16vec4) of the Q, K and V tiles
#else
#define SQ ((HD + 8u) / 4u)     // ... padded: 16-byte aligned rows on distinct bank groups
#endif
#define SP ((BC + 8u) / 4u)     // row stride (f16vec4) of the P tile
#define FD (HD / 16u)           // fragments along head_dim
#define FC (BC / 16u)           // fragments along a block
#define HD8 (HD / 8u)           // uvec4 (8 halves) per head row
#define LKV (BC * HD8 / NT)     // uvec4 of K (and of V) per invocation per block
#define SSG (BC * 16u)          // floats of S per subgroup (>= 256: a 16 x 16 chunk fits)
#define HALF (BC / 2u)          // scores per softmax invocation
#define NEG -3.0e38             // masked score and initial running max (finite: no inf - inf)

#if COOPMAT_EMULATE
#define KBASE 0u
#define QBASE (2u * BC * SQ)
#define TILES ((2u * BC + BR) * SQ)
#else
#define KBASE 0u
#define QBASE 0u
#define TILES ((BR > 2u * BC ? BR : 2u * BC) * SQ)
#endif
#define VBASE (KBASE + BC * SQ)

layout(local_size_x = 128) in;

layout(std430, binding = 0) readonly buffer Q { float q[]; };
layout(std430, binding = 1) readonly buffer KC { uvec4 kc[]; };  // 8 f16 per element
layout(std430, binding = 2) readonly buffer VC { uvec4 vc[]; };
layout(std430, binding = 3) readonly buffer Pos { int pos[]; };
layout(std430, binding = 4) writeonly buffer O { float o[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;
    uint n_kv;
    uint hd;
    uint n_ctx;
    uint q_off;
    uint q_stride;
    uint k_off;
    uint v_off;
    uint pos_off;
    uint o_off;
    uint o_stride;
    uint n_splits;
    float scale;
    uint swa;
} p;

shared f16vec4 sh[TILES];        // Q tile [r][d], K tile [c][d], V tile [c][d]
shared f16vec4 shp[BR * SP];     // P [r][c]
shared float ss[NSG * SSG];      // per subgroup: S [16][BC], then a P V chunk [16][16]
shared float red_m[NT];          // a softmax invocation's partial max / sum, for its pair
shared float red_s[NT];
shared float salpha[BR];
shared float sl[BR];

// ------------------------------------------------------------------------------------------
// cooperative-matrix operations (real or emulated)
#if COOPMAT_EMULATE
struct EAcc { float v[8]; };
#define ACC_T EAcc
#define A_T uint
#define B_T uint
#define SG_ID (gl_LocalInvocationID.x >> 5)
#define SG_LANE (gl_LocalInvocationID.x & 31u)
#define SG_SYNC() memoryBarrierShared(); barrier()

EAcc emu_zero() {
    EAcc c;
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        c.v[e] = 0.0;
    }
    return c;
}
float emu_sh(uint h) { return float(sh[h >> 2][h & 3u]); }
float emu_shp(uint h) { return float(shp[h >> 2][h & 3u]); }
// c += A B: A row-major 16 x 16 at halves a (row stride sa) of shp (a_p) or sh; B 16 x 16 of sh
// at halves b: column-major (B[k][n] = sh[b + n sb + k]) or row-major (sh[b + k sb + n])
EAcc emu_mad(bool a_p, uint a, uint sa, uint b, uint sb, bool b_col, EAcc c) {
    const uint lane = SG_LANE;
    const uint n = lane & 15u;
    float bn[16];
    [[unroll]] for (uint k = 0u; k < 16u; ++k) {
        bn[k] = emu_sh(b_col ? b + n * sb + k : b + k * sb + n);
    }
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        const uint r = (lane >> 4) + 2u * e;
        float s = c.v[e];
        [[unroll]] for (uint k = 0u; k < 16u; ++k) {
            s += (a_p ? emu_shp(a + r * sa + k) : emu_sh(a + r * sa + k)) * bn[k];
        }
        c.v[e] = s;
    }
    return c;
}
void emu_store(EAcc c, uint off, uint stride) {
    const uint lane = SG_LANE;
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        ss[off + ((lane >> 4) + 2u * e) * stride + (lane & 15u)] = c.v[e];
    }
}
#define CM_ZERO(c) c = emu_zero()
#define CM_LOAD_Q(f, off4) f = 4u * (off4)
#define CM_LOAD_KT(f, off4) f = 4u * (off4)
#define CM_LOAD_V(f, off4) f = 4u * (off4)
#define CM_LOAD_P(f, off4) f = 4u * (off4)
#define CM_MAD_S(c, a, b) c = emu_mad(false, a, 4u * SQ, b, 4u * SQ, true, c)
#define CM_MAD_PV(c, a, b) c = emu_mad(true, a, 4u * SP, b, 4u * SQ, false, c)
#define CM_STORE(c, off, stride) emu_store(c, off, stride)
#else
#define ACC_T coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define A_T coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define B_T coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define SG_ID gl_SubgroupID
#define SG_LANE gl_SubgroupInvocationID
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#define CM_ZERO(c) c = ACC_T(0.0)
#define CM_LOAD_Q(f, off4) coopMatLoad(f, sh, off4, SQ, gl_CooperativeMatrixLayoutRowMajor)
#define CM_LOAD_KT(f, off4) coopMatLoad(f, sh, off4, SQ, gl_CooperativeMatrixLayoutColumnMajor)
#define CM_LOAD_V(f, off4) coopMatLoad(f, sh, off4, SQ, gl_CooperativeMatrixLayoutRowMajor)
#define CM_LOAD_P(f, off4) coopMatLoad(f, shp, off4, SP, gl_CooperativeMatrixLayoutRowMajor)
#define CM_MAD_S(c, a, b) c = coopMatMulAdd(a, b, c)
#define CM_MAD_PV(c, a, b) c = coopMatMulAdd(a, b, c)
#define CM_STORE(c, off, stride) coopMatStore(c, ss, off, stride, gl_CooperativeMatrixLayoutRowMajor)
#endif

f16vec4 halves(uint a, uint b) { return f16vec4(unpackFloat2x16(a), unpackFloat2x16(b)); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = SG_ID;
    const uint lane = SG_LANE;
    const uint me = 32u * sg + lane;  // this invocation's place in the softmax pairs (2j, 2j + 1)
    const uint g = gl_WorkGroupID.z;
    const uint grp = p.n_heads / p.n_kv;
    const uint R = p.n_tokens * grp;
    const uint r0 = gl_WorkGroupID.y * BR;
    const uint nr = min(BR, R - r0);
    const uint pos0 = uint(max(pos[p.pos_off], 0));
    const uint kv_total = min(pos0 + p.n_tokens, p.n_ctx);
    const uint row_kv8 = p.n_kv * HD8;  // cache row stride in uvec4

    // the scaled queries, rounded to f16 (rows past the block's end: zeros)
    for (uint i = tid; i < BR * HD8; i += NT) {
        const uint r = i / HD8;
        const uint d8 = i % HD8;
        vec4 a = vec4(0.0), b = vec4(0.0);
        if (r < nr) {
            const uint rr = r0 + r;
            const uint t = rr / grp;
            const uint h = g * grp + (rr - t * grp);
            const uint qb = p.q_off + t * p.q_stride + h * HD + 8u * d8;
            a = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * p.scale;
            b = vec4(q[qb + 4u], q[qb + 5u], q[qb + 6u], q[qb + 7u]) * p.scale;
        }
        // clamped to f16's range: an infinite query would make its row's scores inf - inf
        sh[QBASE + r * SQ + 2u * d8] = f16vec4(clamp(a, -65504.0, 65504.0));
        sh[QBASE + r * SQ + 2u * d8 + 1u] = f16vec4(clamp(b, -65504.0, 65504.0));
    }

    // the softmax row of this invocation (two per row) and the positions it sees
    const uint srow = 16u * sg + (lane >> 1);
    const uint shalf = lane & 1u;
    const uint st = (r0 + srow) / grp;
    const uint lim = srow < nr ? min(pos0 + st + 1u, kv_total) : 0u;
    const uint low = p.swa > 0u ? uint(max(int(pos0 + st + 1u) - int(p.swa), 0)) : 0u;
    float m_run = NEG;
    float l_run = 0.0;

    // the positions any row of this workgroup sees: from the first row's window start to the
    // last row's position
    const uint t_last = (r0 + nr - 1u) / grp;
    const uint hi = min(pos0 + t_last + 1u, kv_total);
    const uint lo = p.swa > 0u ? min(uint(max(int(pos0 + r0 / grp + 1u) - int(p.swa), 0)), hi) : 0u;
    const uint kbase = p.k_off / 8u + g * HD8;
    const uint vbase = p.v_off / 8u + g * HD8;

    float acc[FD][8];
    [[unroll]] for (uint f = 0u; f < FD; ++f) {
        [[unroll]] for (uint e = 0u; e < 8u; ++e) {
            acc[f][e] = 0.0;
        }
    }

    barrier();  // the Q tile is in
    A_T qa[FD];
    [[unroll]] for (uint f = 0u; f < FD; ++f) {
        CM_LOAD_Q(qa[f], QBASE + 16u * sg * SQ + 4u * f);
    }
#if !COOPMAT_EMULATE
    barrier();  // every subgroup holds its Q fragments: the K/V tiles may overwrite the Q tile
#endif

    // K and V of the first block into registers
    uvec4 kr[LKV];
    uvec4 vr[LKV];
    {
        const uint nc0 = lo < hi ? min(BC, hi - lo) : 0u;
        [[unroll]] for (uint j = 0u; j < LKV; ++j) {
            const uint i = tid + j * NT;
            kr[j] = uvec4(0u);
            vr[j] = uvec4(0u);
            if (i / HD8 < nc0) {
                kr[j] = kc[kbase + (lo + i / HD8) * row_kv8 + i % HD8];
                vr[j] = vc[vbase + (lo + i / HD8) * row_kv8 + i % HD8];
            }
        }
    }

    for (uint kb = lo; kb < hi; kb += BC) {
        const uint nc = min(BC, hi - kb);
        // 1. the block's K and V into their tiles (positions past the cache: zeros, so that
        //    P = 0 never meets a NaN), then the next block's into registers
        [[unroll]] for (uint j = 0u; j < LKV; ++j) {
            const uint i = tid + j * NT;
            const uint c = i / HD8;
            const uint d8 = i % HD8;
            const uvec4 kk = c < nc ? kr[j] : uvec4(0u);
            const uvec4 vv = c < nc ? vr[j] : uvec4(0u);
            sh[KBASE + c * SQ + 2u * d8] = halves(kk.x, kk.y);
            sh[KBASE + c * SQ + 2u * d8 + 1u] = halves(kk.z, kk.w);
            sh[VBASE + c * SQ + 2u * d8] = halves(vv.x, vv.y);
            sh[VBASE + c * SQ + 2u * d8 + 1u] = halves(vv.z, vv.w);
        }
        const uint kn = kb + BC;
        const uint ncn = kn < hi ? min(BC, hi - kn) : 0u;
        [[unroll]] for (uint j = 0u; j < LKV; ++j) {
            const uint i = tid + j * NT;
            if (i / HD8 < ncn) {
                kr[j] = kc[kbase + (kn + i / HD8) * row_kv8 + i % HD8];
                vr[j] = vc[vbase + (kn + i / HD8) * row_kv8 + i % HD8];
            }
        }
        barrier();  // the tiles are in

        // 2. S = Q K^T for this subgroup's 16 rows
        ACC_T sacc[FC];
        [[unroll]] for (uint c = 0u; c < FC; ++c) {
            CM_ZERO(sacc[c]);
        }
        [[unroll]] for (uint f = 0u; f < FD; ++f) {
            [[unroll]] for (uint c = 0u; c < FC; ++c) {
                B_T kf;
                CM_LOAD_KT(kf, KBASE + 16u * c * SQ + 4u * f);
                CM_MAD_S(sacc[c], qa[f], kf);
            }
        }
        [[unroll]] for (uint c = 0u; c < FC; ++c) {
            CM_STORE(sacc[c], sg * SSG + 16u * c, BC);
        }
        SG_SYNC();

        // 3. online softmax: this invocation's half of its row
        float sv[HALF];
        float mx = NEG;
        [[unroll]] for (uint u = 0u; u < HALF; ++u) {
            const uint col = shalf * HALF + u;
            const uint c = kb + col;
            const float v = ss[sg * SSG + (lane >> 1) * BC + col];
            sv[u] = (col < nc && c < lim && c >= low) ? v : NEG;
            mx = max(mx, sv[u]);
        }
        red_m[me] = mx;
        SG_SYNC();
        mx = max(mx, red_m[me ^ 1u]);
        const float m_new = max(m_run, mx);
        const float alpha = exp(m_run - m_new);
        float sum = 0.0;
        [[unroll]] for (uint u = 0u; u < HALF; u += 4u) {
            vec4 pr;
            [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                pr[k] = sv[u + k] == NEG ? 0.0 : exp(sv[u + k] - m_new);
            }
            // the row's sum over the f16 probabilities P V multiplies, so both agree
            const f16vec4 ph = f16vec4(pr);
            sum += dot(vec4(ph), vec4(1.0));
            shp[srow * SP + (shalf * HALF + u) / 4u] = ph;
        }
        red_s[me] = sum;
        if (shalf == 0u) {
            salpha[srow] = alpha;
        }
        SG_SYNC();
        l_run = l_run * alpha + sum + red_s[me ^ 1u];
        m_run = m_new;

        // 4. O = alpha O + P V, 16 head dims at a time
        A_T pf[FC];
        [[unroll]] for (uint c = 0u; c < FC; ++c) {
            CM_LOAD_P(pf[c], 16u * sg * SP + 4u * c);
        }
        [[unroll]] for (uint f = 0u; f < FD; ++f) {
            ACC_T oacc;
            CM_ZERO(oacc);
            [[unroll]] for (uint c = 0u; c < FC; ++c) {
                B_T vf;
                CM_LOAD_V(vf, VBASE + 16u * c * SQ + 4u * f);
                CM_MAD_PV(oacc, pf[c], vf);
            }
            CM_STORE(oacc, sg * SSG, 16u);
            SG_SYNC();
            [[unroll]] for (uint e = 0u; e < 8u; ++e) {
                const uint r = (lane >> 4) + 2u * e;
                acc[f][e] = acc[f][e] * salpha[16u * sg + r] + ss[sg * SSG + r * 16u + (lane & 15u)];
            }
            SG_SYNC();
        }
        barrier();  // every subgroup is done with the tiles
    }

    if (shalf == 0u) {
        sl[srow] = l_run;
    }
    SG_SYNC();
    [[unroll]] for (uint e = 0u; e < 8u; ++e) {
        const uint r = 16u * sg + (lane >> 4) + 2u * e;
        if (r < nr) {
            const uint rr = r0 + r;
            const uint t = rr / grp;
            const uint h = g * grp + (rr - t * grp);
            const float l = sl[r];
            const float inv = l > 0.0 ? 1.0 / l : 0.0;
            const uint ob = p.o_off + t * p.o_stride + h * HD + (lane & 15u);
            [[unroll]] for (uint f = 0u; f < FD; ++f) {
                o[ob + 16u * f] = acc[f][e] * inv;
            }
        }
    }
}
