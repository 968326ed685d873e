#version 450
// moe_topk: the router of a mixture-of-experts FFN, per token (llama.cpp's build_moe_ffn):
//   probs = softmax(logits) (GATING 1) or sigmoid(logits) (GATING 2) over n_expert logits
//   ids   = the n_used experts of largest probs, largest first; equal probs in increasing
//           expert index (a stable descending sort; ggml-cpu's std::sort leaves exact ties
//           in no set order)
//   w     = probs[ids]; divided by max(sum(w), 6.103515625e-5) when norm is set; times scale
// One workgroup per token. The probs go to shared memory (softmax: max and sum by tree
// reductions); each expert's rank in the (prob descending, index ascending) order is counted
// by its own invocation, and the experts of rank < n_used write their slot. A NaN prob ranks
// after every number, so a token with fewer than n_used non-NaN probs gets id -1 in the
// remaining slots (which the routed product turns into NaN rows: reported as non-finite
// logits). Push constants: n_expert (<= MAXE), n_used, T, l_stride, norm (0/1), scale.

#define WG 256u
#ifndef MAXE
#define MAXE 512u
#endif
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer L { float logits[]; };
layout(std430, binding = 1) writeonly buffer Ids { int ids[]; };
layout(std430, binding = 2) writeonly buffer W { float w[]; };

layout(push_constant) uniform Push {
    uint n_expert; uint n_used; uint T; uint l_stride; uint norm; float scale;
} p;

shared float pr[MAXE];
shared float red[WG];
shared float sel[MAXE];
shared int sid[MAXE];

// whether expert j comes before expert i in the (prob descending, index ascending) order;
// NaNs after every number, among themselves by index
bool before(uint j, uint i) {
    const float a = pr[j];
    const float b = pr[i];
    if (isnan(b)) {
        return !isnan(a) || j < i;
    }
    return !isnan(a) && (a > b || (a == b && j < i));
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint ne = p.n_expert;
    for (uint t = gl_WorkGroupID.x; t < p.T; t += gl_NumWorkGroups.x) {
        const uint lb = t * p.l_stride;
#if GATING == 2
        for (uint i = tid; i < ne; i += WG) {
            pr[i] = 1.0 / (1.0 + exp(-logits[lb + i]));
        }
#else
        float m = uintBitsToFloat(0xff800000u);  // -inf
        for (uint i = tid; i < ne; i += WG) {
            m = max(m, logits[lb + i]);
        }
        red[tid] = m;
        barrier();
        for (uint h = WG / 2u; h > 0u; h >>= 1) {
            if (tid < h) {
                red[tid] = max(red[tid], red[tid + h]);
            }
            barrier();
        }
        m = red[0];
        barrier();
        float s = 0.0;
        for (uint i = tid; i < ne; i += WG) {
            const float e = exp(logits[lb + i] - m);
            pr[i] = e;
            s += e;
        }
        red[tid] = s;
        barrier();
        for (uint h = WG / 2u; h > 0u; h >>= 1) {
            if (tid < h) {
                red[tid] += red[tid + h];
            }
            barrier();
        }
        const float inv = 1.0 / red[0];
        for (uint i = tid; i < ne; i += WG) {
            pr[i] *= inv;
        }
#endif
        barrier();
        for (uint j = tid; j < p.n_used; j += WG) {
            sid[j] = -1;  // (slots no number ranks into)
            sel[j] = 0.0;
        }
        barrier();
        for (uint i = tid; i < ne; i += WG) {
            uint rank = 0u;
            for (uint j = 0u; j < ne; ++j) {
                rank += before(j, i) ? 1u : 0u;
            }
            if (rank < p.n_used && !isnan(pr[i])) {
                sid[rank] = int(i);
                sel[rank] = pr[i];
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
