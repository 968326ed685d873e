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
//   out f32 [n_tokens, n_heads, head_dim] (token stride o_stride), when n_splits == 1;
//       otherwise unnormalised partial outputs and their (max, sum) go to `part`:
//       part[(s * n_rows + row) * head_dim + d], then part[n_splits * n_rows * head_dim +
//       (s * n_rows + row) * 2 + {0: max, 1: sum}], row = t * n_heads + h.
//
// Workgroup (split s, row block, kv head g): the query rows of a block are the pairs
// (token, head) of the heads that share kv head g (head h uses kv head h / (n_heads / n_kv)),
// BR of them, so the K/V block loaded to shared memory serves every head of the group.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_control_flow_attributes : enable

#define NT 128u     // invocations per workgroup
#define BR 16u      // query rows per workgroup
#define BC 32u      // cache positions per block
#define DMAX 128u   // largest head_dim
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
} p;

shared float sq[BR * DMAX];          // scaled queries, [r][d]
shared float skv[BC * (DMAX + 1u)];  // K block, then V block, [c][d], row stride hd + 1
shared float sp[BR * (BC + 1u)];     // scores, then probabilities, [r][c]
shared float sm[BR];                 // running max per row
shared float sl[BR];                 // running sum per row
shared float salpha[BR];             // rescale of the accumulators for this block
shared uint slim[BR];                // exclusive end of the positions row r may see

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
    }

    const uint t_last = (r0 + nr - 1u) / grp;
    const uint kv_hi = min(pos0 + t_last + 1u, kv_total);
    const uint chunk = ((kv_total + p.n_splits - 1u) / p.n_splits + BC - 1u) / BC * BC;
    const uint lo = split * chunk;
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
            if (c < nc && kb + c < slim[r]) {
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
