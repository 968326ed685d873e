#version 450
// moe_combine: the routed experts' outputs weighted and summed per token,
//   y[t, n] = sum_s w[t, s] * e[t, s, n]     (s in increasing slot order)
// e: f32 (T, n_used, N), w: f32 (T, n_used), y: f32 (T, N). Grid: (ceil(N / 256), T).
// Push constants: N, T, n_used.
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x = 256) in;
#define UNR 8u

layout(std430, binding = 0) readonly buffer E { float e[]; };
layout(std430, binding = 1) readonly buffer W { float w[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push { uint N; uint T; uint n_used; } p;

void main() {
    for (uint t = gl_WorkGroupID.y; t < p.T; t += gl_NumWorkGroups.y) {
        for (uint n = gl_GlobalInvocationID.x; n < p.N; n += gl_NumWorkGroups.x * 256u) {
            // the slots' loads UNR at a time, all before the first use, summed in slot order
            float acc = 0.0;
            uint s = 0u;
            for (; s + UNR <= p.n_used; s += UNR) {
                float v[UNR];
                float c[UNR];
                [[unroll]] for (uint k = 0u; k < UNR; ++k) {
                    v[k] = e[(t * p.n_used + s + k) * p.N + n];
                    c[k] = w[t * p.n_used + s + k];
                }
                [[unroll]] for (uint k = 0u; k < UNR; ++k) {
                    acc = fma(c[k], v[k], acc);
                }
            }
            for (; s < p.n_used; ++s) {
                acc = fma(w[t * p.n_used + s], e[(t * p.n_used + s) * p.N + n], acc);
            }
            y[t * p.N + n] = acc;
        }
    }
}
