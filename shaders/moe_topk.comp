#version 450
// moe_topk: the router of a mixture-of-experts FFN, per token (llama.cpp's build_moe_ffn):
//   probs = softmax(logits) (GATING 1) or sigmoid(logits) (GATING 2) over n_expert logits
//   ids   = the n_used experts of largest probs, largest first; equal probs in increasing
//           expert index (a stable descending sort; ggml-cpu's std::sort leaves exact ties
//           in no set order)
//   w     = probs[ids]; divided by max(sum(w), 6.103515625e-5) when norm is set; times scale
// One workgroup of WG invocations per token; invocation tid holds the probs of experts
// tid, tid + WG, ... in registers (MAXE / WG of them). Softmax's max and sum are workgroup
// reductions; then n_used rounds each pick the largest prob not yet taken (the lowest expert
// index among equals: each invocation offers its lowest-index best, the workgroup takes the
// largest value and, among the offers of that value, the lowest index). On a GPU whose
// subgroups are WG wide the reductions are subgroup operations and the barriers between them
// cost nothing (no shared memory round trip per expert, no O(n_expert^2) ranking). A NaN prob
// ranks after every number, so a token with fewer than n_used non-NaN probs gets id -1 in the
// remaining slots (which the routed product turns into NaN rows: reported as non-finite
// logits). Push constants: n_expert (<= MAXE), n_used, T, l_stride, norm (0/1), scale.
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

#define WG 32u
#ifndef MAXE
#define MAXE 512u
#endif
#define PER (MAXE / WG)
#define NONE 0xffffffffu
layout(local_size_x = 32) in;

layout(std430, binding = 0) readonly buffer L { float logits[]; };
layout(std430, binding = 1) writeonly buffer Ids { int ids[]; };
layout(std430, binding = 2) writeonly buffer W { float w[]; };

layout(push_constant) uniform Push {
    uint n_expert; uint n_used; uint T; uint l_stride; uint norm; float scale;
} p;

shared float red[WG];  // one partial per subgroup (sized for 1-wide subgroups)
shared uint redi[WG];
shared float sel[MAXE];
shared int sid[MAXE];

// the workgroup's max / sum / min of v: subgroup reductions, then one partial per subgroup
float wg_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) {
        red[gl_SubgroupID] = v;
    }
    barrier();
    float t = red[0];
    for (uint i = 1u; i < gl_NumSubgroups; ++i) {
        t = max(t, red[i]);
    }
    barrier();  // red[] is reused
    return t;
}

float wg_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) {
        red[gl_SubgroupID] = v;
    }
    barrier();
    float t = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; ++i) {
        t += red[i];
    }
    barrier();
    return t;
}

uint wg_min(uint v) {
    v = subgroupMin(v);
    if (subgroupElect()) {
        redi[gl_SubgroupID] = v;
    }
    barrier();
    uint t = redi[0];
    for (uint i = 1u; i < gl_NumSubgroups; ++i) {
        t = min(t, redi[i]);
    }
    barrier();
    return t;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint ne = p.n_expert;
    for (uint t = gl_WorkGroupID.x; t < p.T; t += gl_NumWorkGroups.x) {
        const uint lb = t * p.l_stride;
        float pr[PER];
#if GATING == 2
        [[unroll]] for (uint k = 0u; k < PER; ++k) {
            const uint i = tid + k * WG;
            pr[k] = i < ne ? 1.0 / (1.0 + exp(-logits[lb + i])) : 0.0;
        }
#else
        const float NEG_INF = uintBitsToFloat(0xff800000u);
        float m = NEG_INF;
        [[unroll]] for (uint k = 0u; k < PER; ++k) {
            const uint i = tid + k * WG;
            pr[k] = i < ne ? logits[lb + i] : NEG_INF;
            m = max(m, pr[k]);
        }
        m = wg_max(m);
        float s = 0.0;
        [[unroll]] for (uint k = 0u; k < PER; ++k) {
            const uint i = tid + k * WG;
            pr[k] = i < ne ? exp(pr[k] - m) : 0.0;
            s += pr[k];
        }
        const float inv = 1.0 / wg_sum(s);
        [[unroll]] for (uint k = 0u; k < PER; ++k) {
            pr[k] *= inv;
        }
#endif
        // taken: bit k for expert tid + k * WG (past n_expert: taken from the start)
        uint taken = 0u;
        [[unroll]] for (uint k = 0u; k < PER; ++k) {
            if (tid + k * WG >= ne) {
                taken |= 1u << k;
            }
        }
        for (uint r = 0u; r < p.n_used; ++r) {
            // this invocation's offer: its largest prob not taken (NaN never offered: -1 = none;
            // probs are >= 0), the lowest index among equals (k ascending, strict >)
            float bv = -1.0;
            uint bk = NONE;
            [[unroll]] for (uint k = 0u; k < PER; ++k) {
                if ((taken & (1u << k)) == 0u && !isnan(pr[k]) && pr[k] > bv) {
                    bv = pr[k];
                    bk = k;
                }
            }
            const float top = wg_max(bv);
            const uint who = wg_min(bk != NONE && bv == top ? tid + bk * WG : NONE);
            if (who != NONE && who % WG == tid) {
                taken |= 1u << (who / WG);
            }
            if (tid == 0u) {
                sid[r] = who == NONE ? -1 : int(who);
                sel[r] = who == NONE ? 0.0 : top;
            }
        }
        barrier();
        // the sum in slot order, by every invocation alike (the same value everywhere)
        float total = 0.0;
        for (uint j = 0u; j < p.n_used; ++j) {
            total += sel[j];
        }
        const float d = p.norm != 0u ? 1.0 / max(total, 6.103515625e-5) : 1.0;
        for (uint j = tid; j < p.n_used; j += WG) {
            ids[t * p.n_used + j] = sid[j];
            w[t * p.n_used + j] = sel[j] * d * p.scale;
        }
        barrier();
    }
}
