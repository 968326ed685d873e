#version 450
#extension GL_EXT_control_flow_attributes : require
// argmax_f32: index (int32) of the largest element of each row of a 2-D f32 tensor. Ties go
// to the lowest index. A row holding any NaN or +infinity gives -1 instead: the caller reports
// non-finite logits (non-finite weights, most likely) rather than decode a meaningless id
// (-infinity never wins, so it is allowed).
// One workgroup per row. A decode step's one row of a large vocabulary is one workgroup's
// work, so its time is the latency of each invocation's loads: they are issued UNR at a time,
// all before the first comparison (a loop of one load per iteration waits for each), and a
// step of few rows takes the wide workgroup (WG, constant_id 0: 1024).

layout(constant_id = 0) const uint WG = 256u;
layout(local_size_x_id = 0) in;
#define UNR 8u
#define NONE 0xffffffffu

layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer Dst { int d[]; };

layout(push_constant) uniform Push {
    uint ncols;
    uint nrows;
    uint x_off;
    uint x_stride;
    uint d_off;
} p;

shared float red_v[WG];
shared uint red_i[WG];
shared uint bad;

void main() {
    uint tid = gl_LocalInvocationID.x;
    const float NEG_INF = uintBitsToFloat(0xff800000u);
    for (uint row = gl_WorkGroupID.x; row < p.nrows; row += gl_NumWorkGroups.x) {
        uint xb = p.x_off + row * p.x_stride;
        float best = NEG_INF;
        uint bi = NONE;
        bool nonfinite = false;
        if (tid == 0u) {
            bad = 0u;
        }
        barrier();
        for (uint c0 = tid; c0 < p.ncols; c0 += UNR * WG) {
            float v[UNR];
            [[unroll]] for (uint k = 0u; k < UNR; ++k) {
                const uint c = c0 + k * WG;
                v[k] = c < p.ncols ? x[xb + c] : NEG_INF;
            }
            // increasing c: strict > keeps the lowest
            [[unroll]] for (uint k = 0u; k < UNR; ++k) {
                const uint c = c0 + k * WG;
                if (c < p.ncols) {
                    nonfinite = nonfinite || isnan(v[k]) || (isinf(v[k]) && v[k] > 0.0);
                    if (v[k] > best || (v[k] == best && bi == NONE)) {
                        best = v[k];
                        bi = c;
                    }
                }
            }
        }
        red_v[tid] = best;
        red_i[tid] = bi;
        if (nonfinite) {
            atomicOr(bad, 1u);
        }
        barrier();
        for (uint k = WG / 2u; k > 0u; k >>= 1) {
            if (tid < k) {
                float v2 = red_v[tid + k];
                uint i2 = red_i[tid + k];
                float v1 = red_v[tid];
                uint i1 = red_i[tid];
                if (i2 != NONE && (i1 == NONE || v2 > v1 || (v2 == v1 && i2 < i1))) {
                    red_v[tid] = v2;
                    red_i[tid] = i2;
                }
            }
            barrier();
        }
        if (tid == 0u) {
            uint r = red_i[0];
            d[p.d_off + row] = bad != 0u ? -1 : int(r == NONE ? 0u : r);
        }
        barrier();
    }
}
