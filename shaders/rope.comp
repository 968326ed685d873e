#version 450
// rope_f32 / rope_neox_f32: rotary position embedding of an f32 tensor
// [n_tokens, n_heads, head_dim] (token and head strides in elements), as ggml's rope with
// ext_factor = 0, attn_factor = 1: for i < n_dims/2,
// theta_i = pos[t] * freq_scale * freq_base^(-2i/n_dims) / ff[i]
// (ff: ggml's freq_factors, llama 3.x's rope_freqs.weight, read only when has_ff != 0),
//   normal (NEOX = 0, llama): rotate the pair (2i, 2i+1),
//   NeoX (NEOX = 1): rotate the pair (i, i + n_dims/2),
// (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos); elements from n_dims on are copied.
// Positions are int32, one per token, read from a buffer. One invocation per pair;
// in-place use (dst == x) is allowed.
// YARN = 1 (rope_yarn_f32 / rope_yarn_neox_f32): ggml's rope_yarn on top of that: with
// theta_extrap = pos * freq_base^(-2i/n_dims) / ff[i] and theta_interp = freq_scale * theta_extrap,
// when ext_factor != 0 the angle is theta_interp (1 - r) + theta_extrap r, r = ext_factor *
// ramp(i) (ramp: 1 below corr_lo, 0 above corr_hi, linear between, as ggml's rope_yarn_ramp),
// and cos/sin are multiplied by mscale (the host's attn_factor * (1 + 0.1 ln(1/freq_scale))
// when ext_factor != 0, else attn_factor). With ext_factor = 0 and mscale = 1 it computes
// exactly what YARN = 0 does; the YARN = 0 kernels stay as they are for the unscaled models.

#include "common.glsl"

layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Pos { int pos[]; };
layout(std430, binding = 2) writeonly buffer Dst { float d[]; };
layout(std430, binding = 3) readonly buffer FF { float ff[]; };

layout(push_constant) uniform Push {
    uint head_dim;
    uint n_heads;
    uint n_tokens;
    uint n_dims;
    uint x_off;
    uint x_tstride;
    uint x_hstride;
    uint d_off;
    uint d_tstride;
    uint d_hstride;
    uint pos_off;
    float theta_log2;  // -2 log2(freq_base) / n_dims
    float freq_scale;
    uint has_ff;
#if YARN
    float corr_lo;     // ggml's corr_dims[0], [1]: the pairs where the ramp goes from 1 to 0
    float corr_hi;
    float ext_factor;
    float mscale;
#endif
} p;

#if YARN
// cos and sin of pair j's angle at position ps, times mscale (ggml's rope_yarn); the
// interpolated angle is formed as in the YARN = 0 kernel
void rope_yarn_cs(float ps, uint j, out float c, out float s) {
    float fb = exp2(float(j) * p.theta_log2);
    float freq = p.freq_scale * fb;
    if (p.has_ff != 0u) {
        freq /= ff[j];
        fb /= ff[j];
    }
    float theta = ps * freq;  // theta_interp
    if (p.ext_factor != 0.0) {
        float y = (float(j) - p.corr_lo) / max(0.001, p.corr_hi - p.corr_lo);
        float mix = (1.0 - min(1.0, max(0.0, y))) * p.ext_factor;
        theta = theta * (1.0 - mix) + (ps * fb) * mix;
    }
    theta = reduce_2pi(theta);
    c = cos(theta) * p.mscale;
    s = sin(theta) * p.mscale;
}
#endif

void main() {
    uint half_hd = p.head_dim / 2u;
    uint half_nd = p.n_dims / 2u;
    uint total = p.n_tokens * p.n_heads * half_hd;
    uint step = gl_NumWorkGroups.x * 256u;
    for (uint idx = gl_GlobalInvocationID.x; idx < total; idx += step) {
        uint j = idx % half_hd;
        uint th = idx / half_hd;
        uint h = th % p.n_heads;
        uint t = th / p.n_heads;
        uint xb = p.x_off + t * p.x_tstride + h * p.x_hstride;
        uint db = p.d_off + t * p.d_tstride + h * p.d_hstride;
        if (j < half_nd) {
#if NEOX
            uint e0 = j;
            uint e1 = j + half_nd;
#else
            uint e0 = 2u * j;
            uint e1 = 2u * j + 1u;
#endif
#if YARN
            float c, s;
            rope_yarn_cs(float(pos[p.pos_off + t]), j, c, s);
#else
            float freq = p.freq_scale * exp2(float(j) * p.theta_log2);
            if (p.has_ff != 0u) {
                freq /= ff[j];
            }
            float theta = reduce_2pi(float(pos[p.pos_off + t]) * freq);
            float c = cos(theta);
            float s = sin(theta);
#endif
            float x0 = x[xb + e0];
            float x1 = x[xb + e1];
            d[db + e0] = x0 * c - x1 * s;
            d[db + e1] = x0 * s + x1 * c;
        } else {
            float x0 = x[xb + 2u * j];
            float x1 = x[xb + 2u * j + 1u];
            d[db + 2u * j] = x0;
            d[db + 2u * j + 1u] = x1;
        }
    }
}
