#version 450
// attn_f16_f32: causal attention of f32 queries over an f16 KV cache, grouped-query heads,
// flash-attention style (online softmax over blocks of BC cache positions), optionally split
// over the KV length (flash-decoding) with attn_combine_f32 merging the splits.
//
//   q   f32 [n_tokens, n_heads, head_dim] (token stride q_stride, heads contiguous)
//   K,V f16 [n_ctx, n_kv, head_dim] (the cache; contiguous)
//   pos int32: pos0 = pos[pos_off] is the absolute position of token 0; token t (position
//       pos0 + t) attends to cache positions 0 .. pos0 + t. Read from a buffer, so one
//       recorded command buffer serves every decode step.
//   swa (push constant): a sliding window when > 0: token t sees only the cache positions j
//       with (pos0 + t) - j < swa (llama.cpp's LLAMA_SWA_TYPE_STANDARD); the splits of a
//       workgroup then cover only [first visible position, end).
//   out f32 [n_tokens, n_heads, head_dim] (token stride o_stride), when n_splits == 1;
//       otherwise unnormalised partial outputs and their (max, sum) go to `part`:
//       part[(s * n_rows + row) * head_dim + d], then part[n_splits * n_rows * head_dim +
//       (s * n_rows + row) * 2 + {0: max, 1: sum}], row = t * n_heads + h.
//
// Workgroup (split s, row block, kv head g): the query rows of a block are the pairs
// (token, head) of the heads that share kv head g (head h uses kv head h / (n_heads / n_kv)),
// BR of them, so the K/V block loaded to shared memory serves every head of the group.
//
// Two paths (the define TILED), same bindings, push constants and grid; their sizes are
// specialization constants (one SPIR-V module per path):
//   TILED 0 (attn_f16_f32): any head_dim <= DMAX = 128 at run time, one dot product per
//     invocation; the fallback. attn_f16_f32_h256 (BR 8, BC 16, DMAX 256): any head_dim <= 256
//     (Gemma 3), 8 query rows and 16 cache positions a block, so the tiles stay in about the
//     shared memory of the 128 path. BR * DMAX / NT must be OPT (16): the host's variants are.
//   TILED 1, HD = 64 or 128 (attn_f16_f32_d64/_d128): head_dim fixed when the pipeline is made;
//     vec4 shared memory tiles, register-blocked scores (2 rows x 2 positions per invocation)
//     and output (PRT rows x 4 dims per invocation), 8-byte cache loads (cache offsets
//     multiple of 4) issued one step ahead, softmax reductions spread over all invocations.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_control_flow_attributes : enable


#ifndef TILED
#define TILED 0
#endif

#if TILED
layout(constant_id = 0) const uint HD = 128;  // head_dim: a multiple of 32 (PRT, JL whole)
#define NT 128u
#define BR 16u          // query rows per workgroup
#define BC 32u          // cache positions per block
#define DV (HD / 4u)    // vec4 per head
#define KS (DV + 1u)    // padded row stride (vec4) of the K/V tile: odd, so no bank conflicts
#define SPS (BC + 1u)   // row stride of the probability tile
#define PRT (BR * DV / NT)  // output rows per invocation (HD 128: 4, HD 64: 2)
#define JL (BC * DV / NT)   // cache vec4 per invocation per block (HD 128: 8, HD 64: 4)
#define NEG -3.0e38

layout(local_size_x = 128) in;

layout(std430, binding = 0) readonly buffer Q { float q[]; };
layout(std430, binding = 1) readonly buffer KC { uvec2 kc[]; };  // 4 f16 per element
layout(std430, binding = 2) readonly buffer VC { uvec2 vc[]; };
layout(std430, binding = 3) readonly buffer Pos { int pos[]; };
layout(std430, binding = 4) writeonly buffer O { float o[]; };
layout(std430, binding = 5) writeonly buffer Part { float part[]; };

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

shared vec4 sq[BR * DV];       // scaled queries [r][d4]
shared vec4 skv[BC * KS];      // K block, then V block [c][d4]
shared float sp[BR * SPS];     // probabilities [r][c]
shared float red_m[BR * 16u];  // per-row partial maxima [r][column group]
shared float red_s[BR * 16u];  // per-row partial sums
shared float salpha[BR];
shared float sl[BR];
shared float sm[BR];

vec4 unpack4(uvec2 u) { return vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y)); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint split = gl_WorkGroupID.x;
    const uint g = gl_WorkGroupID.z;
    const uint grp = p.n_heads / p.n_kv;
    const uint R = p.n_tokens * grp;
    const uint r0 = gl_WorkGroupID.y * BR;
    const uint nr = min(BR, R - r0);
    const uint pos0 = uint(max(pos[p.pos_off], 0));
    const uint kv_total = min(pos0 + p.n_tokens, p.n_ctx);
    const uint row_kv4 = p.n_kv * DV;  // cache row stride in vec4

    for (uint i = tid; i < nr * DV; i += NT) {
        uint r = i / DV;
        uint d4 = i % DV;
        uint rr = r0 + r;
        uint t = rr / grp;
        uint h = g * grp + (rr - t * grp);
        uint b = p.q_off + t * p.q_stride + h * HD + 4u * d4;
        sq[r * DV + d4] = vec4(q[b], q[b + 1u], q[b + 2u], q[b + 3u]) * p.scale;
    }

    // scores: rows 2 rg + {0, 1}, positions cg + {0, 16}
    const uint cg = tid % 16u;
    const uint rg = tid / 16u;
    const uint ra = 2u * rg;
    const uint rb = ra + 1u;
    const uint lim_a = min(pos0 + (r0 + ra) / grp + 1u, kv_total);
    const uint lim_b = min(pos0 + (r0 + rb) / grp + 1u, kv_total);
    // sliding window: the first position each row sees (0 without a window)
    const uint low_a = p.swa > 0u ? max(int(pos0 + (r0 + ra) / grp + 1u) - int(p.swa), 0) : 0u;
    const uint low_b = p.swa > 0u ? max(int(pos0 + (r0 + rb) / grp + 1u) - int(p.swa), 0) : 0u;
    float m_a = NEG, m_b = NEG, l_a = 0.0, l_b = 0.0;

    // output: dims 4 d4 .. 4 d4 + 3 of rows orow + i
    const uint od4 = tid % DV;
    const uint orow = (tid / DV) * PRT;
    vec4 acc[PRT];
    [[unroll]] for (uint i = 0u; i < PRT; i++) {
        acc[i] = vec4(0.0);
    }

    const uint t_last = (r0 + nr - 1u) / grp;
    const uint kv_hi = min(pos0 + t_last + 1u, kv_total);
    // the first position any row of this workgroup sees (its first row: positions grow with t)
    const uint base = p.swa > 0u ? min(uint(max(int(pos0 + r0 / grp + 1u) - int(p.swa), 0)), kv_total) : 0u;
    const uint chunk = ((kv_total - base + p.n_splits - 1u) / p.n_splits + BC - 1u) / BC * BC;
    const uint lo = base + split * chunk;
    const uint hi = min(lo + chunk, kv_hi);
    const uint kbase0 = p.k_off / 4u + g * DV;
    const uint vbase0 = p.v_off / 4u + g * DV;
    // The cache is read into registers one step ahead (K of the next block while this block's
    // scores are computed, V while its softmax runs), so global latency overlaps the math.
    uvec2 kr[JL];
    uvec2 vr[JL];
    if (lo < hi) {
        const uint nc0 = min(BC, hi - lo);
        [[unroll]] for (uint j = 0u; j < JL; j++) {
            uint i = tid + j * NT;
            if (i / DV < nc0) {
                kr[j] = kc[kbase0 + (lo + i / DV) * row_kv4 + i % DV];
            }
        }
    }
    barrier();

    for (uint kb = lo; kb < hi; kb += BC) {
        const uint nc = min(BC, hi - kb);
        [[unroll]] for (uint j = 0u; j < JL; j++) {
            uint i = tid + j * NT;
            if (i / DV < nc) {
                skv[(i / DV) * KS + i % DV] = unpack4(kr[j]);
                vr[j] = vc[vbase0 + (kb + i / DV) * row_kv4 + i % DV];
            }
        }
        barrier();
        float s_a0 = NEG, s_a1 = NEG, s_b0 = NEG, s_b1 = NEG;
        if (ra < nr) {
            float a0 = 0.0, a1 = 0.0, b0 = 0.0, b1 = 0.0;
            [[unroll]] for (uint d4 = 0u; d4 < DV; d4++) {
                vec4 qa = sq[ra * DV + d4];
                vec4 qb = sq[rb * DV + d4];
                vec4 k0 = skv[cg * KS + d4];
                vec4 k1 = skv[(cg + 16u) * KS + d4];
                a0 += dot(qa, k0);
                a1 += dot(qa, k1);
                b0 += dot(qb, k0);
                b1 += dot(qb, k1);
            }
            uint c0 = kb + cg;
            uint c1 = kb + cg + 16u;
            bool v0 = cg < nc;
            bool v1 = cg + 16u < nc;
            s_a0 = (v0 && c0 < lim_a && c0 >= low_a) ? a0 : NEG;
            s_a1 = (v1 && c1 < lim_a && c1 >= low_a) ? a1 : NEG;
            s_b0 = (v0 && c0 < lim_b && c0 >= low_b && rb < nr) ? b0 : NEG;
            s_b1 = (v1 && c1 < lim_b && c1 >= low_b && rb < nr) ? b1 : NEG;
        }
        red_m[ra * 16u + cg] = max(s_a0, s_a1);
        red_m[rb * 16u + cg] = max(s_b0, s_b1);
        const uint kn = kb + BC;
        const uint ncn = kn < hi ? min(BC, hi - kn) : 0u;
        [[unroll]] for (uint j = 0u; j < JL; j++) {
            uint i = tid + j * NT;
            if (i / DV < ncn) {
                kr[j] = kc[kbase0 + (kn + i / DV) * row_kv4 + i % DV];
            }
        }
        barrier();  // every score is computed: K may be overwritten by V
        [[unroll]] for (uint j = 0u; j < JL; j++) {
            uint i = tid + j * NT;
            if (i / DV < nc) {
                skv[(i / DV) * KS + i % DV] = unpack4(vr[j]);
            }
        }
        float mx_a = m_a, mx_b = m_b;
        [[unroll]] for (uint j = 0u; j < 16u; j++) {
            mx_a = max(mx_a, red_m[ra * 16u + j]);
            mx_b = max(mx_b, red_m[rb * 16u + j]);
        }
        float al_a = exp(m_a - mx_a);
        float al_b = exp(m_b - mx_b);
        float p_a0 = s_a0 == NEG ? 0.0 : exp(s_a0 - mx_a);
        float p_a1 = s_a1 == NEG ? 0.0 : exp(s_a1 - mx_a);
        float p_b0 = s_b0 == NEG ? 0.0 : exp(s_b0 - mx_b);
        float p_b1 = s_b1 == NEG ? 0.0 : exp(s_b1 - mx_b);
        sp[ra * SPS + cg] = p_a0;
        sp[ra * SPS + cg + 16u] = p_a1;
        sp[rb * SPS + cg] = p_b0;
        sp[rb * SPS + cg + 16u] = p_b1;
        red_s[ra * 16u + cg] = p_a0 + p_a1;
        red_s[rb * 16u + cg] = p_b0 + p_b1;
        if (cg == 0u) {
            salpha[ra] = al_a;
            salpha[rb] = al_b;
        }
        m_a = mx_a;
        m_b = mx_b;
        barrier();  // probabilities, sums and the V block are in
        float su_a = 0.0, su_b = 0.0;
        [[unroll]] for (uint j = 0u; j < 16u; j++) {
            su_a += red_s[ra * 16u + j];
            su_b += red_s[rb * 16u + j];
        }
        l_a = l_a * al_a + su_a;
        l_b = l_b * al_b + su_b;
        [[unroll]] for (uint i = 0u; i < PRT; i++) {
            acc[i] *= salpha[orow + i];
        }
        for (uint c = 0u; c < nc; c++) {
            vec4 v = skv[c * KS + od4];
            [[unroll]] for (uint i = 0u; i < PRT; i++) {
                acc[i] += sp[(orow + i) * SPS + c] * v;
            }
        }
        barrier();  // before the next block overwrites skv, sp, red_*
    }

    if (cg == 0u) {
        sl[ra] = l_a;
        sl[rb] = l_b;
        sm[ra] = m_a;
        sm[rb] = m_b;
    }
    barrier();
    const uint n_rows = p.n_tokens * p.n_heads;
    [[unroll]] for (uint i = 0u; i < PRT; i++) {
        uint r = orow + i;
        if (r < nr) {
            uint rr = r0 + r;
            uint t = rr / grp;
            uint h = g * grp + (rr - t * grp);
            if (p.n_splits == 1u) {
                float l = sl[r];
                vec4 v = l > 0.0 ? acc[i] / l : vec4(0.0);
                uint b = p.o_off + t * p.o_stride + h * HD + 4u * od4;
                o[b] = v.x;
                o[b + 1u] = v.y;
                o[b + 2u] = v.z;
                o[b + 3u] = v.w;
            } else {
                uint b = (split * n_rows + t * p.n_heads + h) * HD + 4u * od4;
                part[b] = acc[i].x;
                part[b + 1u] = acc[i].y;
                part[b + 2u] = acc[i].z;
                part[b + 3u] = acc[i].w;
            }
        }
    }
    if (p.n_splits != 1u && tid < nr) {
        uint rr = r0 + tid;
        uint t = rr / grp;
        uint h = g * grp + (rr - t * grp);
        uint mb = p.n_splits * n_rows * HD + (split * n_rows + t * p.n_heads + h) * 2u;
        part[mb] = sm[tid];
        part[mb + 1u] = sl[tid];
    }
}

#else
#define NT 128u     // invocations per workgroup
layout(constant_id = 0) const uint BR = 16;     // query rows per workgroup
layout(constant_id = 1) const uint BC = 32;     // cache positions per block
layout(constant_id = 2) const uint DMAX = 128;  // largest head_dim
#define OPT 16      // output entries per invocation: BR * DMAX / NT
#define NEG -3.0e38 // "masked" score and initial running max (finite: no inf - inf)

layout(local_size_x = 128) in;

layout(std430, binding = 0) readonly buffer Q { float q[]; };
layout(std430, binding = 1) readonly buffer KC { float16_t kc[]; };
layout(std430, binding = 2) readonly buffer VC { float16_t vc[]; };
layout(std430, binding = 3) readonly buffer Pos { int pos[]; };
layout(std430, binding = 4) writeonly buffer O { float o[]; };
layout(std430, binding = 5) writeonly buffer Part { float part[]; };

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

shared float sq[BR * DMAX];          // scaled queries, [r][d]
shared float skv[BC * (DMAX + 1u)];  // K block, then V block, [c][d], row stride hd + 1
shared float sp[BR * (BC + 1u)];     // scores, then probabilities, [r][c]
shared float sm[BR];                 // running max per row
shared float sl[BR];                 // running sum per row
shared float salpha[BR];             // rescale of the accumulators for this block
shared uint slim[BR];                // exclusive end of the positions row r may see
shared uint slo[BR];                 // first position row r may see (sliding window; else 0)

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint split = gl_WorkGroupID.x;
    const uint g = gl_WorkGroupID.z;
    const uint D = p.hd;
    const uint grp = p.n_heads / p.n_kv;
    const uint R = p.n_tokens * grp;
    const uint r0 = gl_WorkGroupID.y * BR;
    const uint nr = min(BR, R - r0);
    const uint pos0 = uint(max(pos[p.pos_off], 0));
    const uint kv_total = min(pos0 + p.n_tokens, p.n_ctx);
    const uint row_kv = p.n_kv * D;
    const uint kd = D + 1u;

    for (uint i = tid; i < nr * D; i += NT) {
        uint r = i / D;
        uint d = i - r * D;
        uint rr = r0 + r;
        uint t = rr / grp;
        uint h = g * grp + (rr - t * grp);
        sq[r * D + d] = q[p.q_off + t * p.q_stride + h * D + d] * p.scale;
    }
    if (tid < BR) {
        sm[tid] = NEG;
        sl[tid] = 0.0;
        uint t = (r0 + tid) / grp;
        slim[tid] = min(pos0 + t + 1u, kv_total);
        slo[tid] = p.swa > 0u ? uint(max(int(pos0 + t + 1u) - int(p.swa), 0)) : 0u;
    }

    const uint t_last = (r0 + nr - 1u) / grp;
    const uint kv_hi = min(pos0 + t_last + 1u, kv_total);
    // the first position any row of this workgroup sees (its first row: positions grow with t)
    const uint base = p.swa > 0u ? min(uint(max(int(pos0 + r0 / grp + 1u) - int(p.swa), 0)), kv_total) : 0u;
    const uint chunk = ((kv_total - base + p.n_splits - 1u) / p.n_splits + BC - 1u) / BC * BC;
    const uint lo = base + split * chunk;
    const uint hi = min(lo + chunk, kv_hi);

    float acc[OPT];
    [[unroll]] for (int k = 0; k < OPT; k++) {
        acc[k] = 0.0;
    }
    barrier();

    for (uint kb = lo; kb < hi; kb += BC) {
        const uint nc = min(BC, hi - kb);
        const uint kbase = p.k_off + kb * row_kv + g * D;
        for (uint i = tid; i < nc * D; i += NT) {
            uint c = i / D;
            uint d = i - c * D;
            skv[c * kd + d] = float(kc[kbase + c * row_kv + d]);
        }
        barrier();
        for (uint i = tid; i < nr * BC; i += NT) {
            uint r = i / BC;
            uint c = i % BC;
            float s = NEG;
            if (c < nc && kb + c < slim[r] && kb + c >= slo[r]) {
                float a = 0.0;
                for (uint d = 0u; d < D; d++) {
                    a += sq[r * D + d] * skv[c * kd + d];
                }
                s = a;
            }
            sp[r * (BC + 1u) + c] = s;
        }
        barrier();
        if (tid < nr) {
            const uint pb = tid * (BC + 1u);
            float mo = sm[tid];
            float mx = mo;
            for (uint c = 0u; c < BC; c++) {
                mx = max(mx, sp[pb + c]);
            }
            float sum = 0.0;
            for (uint c = 0u; c < BC; c++) {
                float s = sp[pb + c];
                float e = s == NEG ? 0.0 : exp(s - mx);
                sp[pb + c] = e;
                sum += e;
            }
            float al = exp(mo - mx);
            salpha[tid] = al;
            sl[tid] = sl[tid] * al + sum;
            sm[tid] = mx;
        }
        // every invocation is past the scores, so K may be overwritten by V
        const uint vbase = p.v_off + kb * row_kv + g * D;
        for (uint i = tid; i < nc * D; i += NT) {
            uint c = i / D;
            uint d = i - c * D;
            skv[c * kd + d] = float(vc[vbase + c * row_kv + d]);
        }
        barrier();
        [[unroll]] for (int k = 0; k < OPT; k++) {
            uint i = tid + uint(k) * NT;
            uint r = i / D;
            if (r < nr) {
                uint d = i - r * D;
                float a = acc[k] * salpha[r];
                const uint pb = r * (BC + 1u);
                for (uint c = 0u; c < nc; c++) {
                    a += sp[pb + c] * skv[c * kd + d];
                }
                acc[k] = a;
            }
        }
        barrier();
    }

    const uint n_rows = p.n_tokens * p.n_heads;
    [[unroll]] for (int k = 0; k < OPT; k++) {
        uint i = tid + uint(k) * NT;
        uint r = i / D;
        if (r < nr) {
            uint d = i - r * D;
            uint rr = r0 + r;
            uint t = rr / grp;
            uint h = g * grp + (rr - t * grp);
            if (p.n_splits == 1u) {
                float l = sl[r];
                o[p.o_off + t * p.o_stride + h * D + d] = l > 0.0 ? acc[k] / l : 0.0;
            } else {
                part[(split * n_rows + t * p.n_heads + h) * D + d] = acc[k];
            }
        }
    }
    if (p.n_splits != 1u && tid < nr) {
        uint rr = r0 + tid;
        uint t = rr / grp;
        uint h = g * grp + (rr - t * grp);
        uint mb = p.n_splits * n_rows * D + (split * n_rows + t * p.n_heads + h) * 2u;
        part[mb] = sm[tid];
        part[mb + 1u] = sl[tid];
    }
}

#endif
