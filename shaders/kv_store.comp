#version 450
// kv_store_f32_f16: write the current tokens' K and V (f32 rows [n_tokens, row_len], row_len =
// n_kv_heads * head_dim, token stride in elements) into f16 caches [n_ctx, row_len] at the
// positions read from an int32 buffer (one per token), so one recorded command buffer serves
// every step. Rounding is round-to-nearest-even in integer bit math (bit-exact with numpy).
// Positions outside [0, n_ctx) are skipped. gl_WorkGroupID.z: 0 = K, 1 = V.
// ROPE = 1 (kv_store_rope[_neox]_f32_f16): K is rotated on its way into the cache, with the
// same formula and operations as rope.comp (frequency factors included; rope then store, up to
// FMA contraction): the RoPE of
// K and the store are one dispatch and one barrier level.
// YARN = 1 (kv_store_rope_yarn[_neox]_f32_f16): the RoPE of K with ggml's YaRN terms, the
// same formula and operations as rope.comp's YARN = 1 (ramp between corr_lo and corr_hi mixing
// the interpolated and extrapolated angles by ext_factor, cos/sin times mscale).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#include "common.glsl"

layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer K { uint k[]; };
layout(std430, binding = 1) readonly buffer V { uint v[]; };
layout(std430, binding = 2) readonly buffer Pos { int pos[]; };
layout(std430, binding = 3) writeonly buffer KC { uint16_t kc[]; };
layout(std430, binding = 4) writeonly buffer VC { uint16_t vc[]; };
#if ROPE
layout(std430, binding = 5) readonly buffer FF { float ff[]; };  // freq factors when has_ff != 0
#endif

layout(push_constant) uniform Push {
    uint n_tokens;
    uint row_len;
    uint n_ctx;
    uint k_off;
    uint k_stride;
    uint v_off;
    uint v_stride;
    uint pos_off;
    uint kc_off;
    uint vc_off;
#if ROPE
    uint head_dim;
    uint n_dims;
    float theta_log2;  // -2 log2(freq_base) / n_dims
    float freq_scale;
    uint has_ff;
#if YARN
    float corr_lo;
    float corr_hi;
    float ext_factor;
    float mscale;
#endif
#endif
} p;

#if ROPE
// K element c of token t (row base kb), rotated at position ps
float roped_k(uint kb, uint c, int ps) {
    uint e = c % p.head_dim;
    if (e >= p.n_dims) {
        return uintBitsToFloat(k[kb + c]);
    }
    uint half_nd = p.n_dims / 2u;
#if NEOX
    uint j = e % half_nd;
    bool second = e >= half_nd;
    uint c0 = second ? c - half_nd : c;
    uint c1 = c0 + half_nd;
#else
    uint j = e / 2u;
    bool second = (e & 1u) == 1u;
    uint c0 = second ? c - 1u : c;
    uint c1 = c0 + 1u;
#endif
#if YARN
    float fb = exp2(float(j) * p.theta_log2);
    float freq = p.freq_scale * fb;
    if (p.has_ff != 0u) {
        freq /= ff[j];
        fb /= ff[j];
    }
    float theta = float(ps) * freq;  // theta_interp
    if (p.ext_factor != 0.0) {
        float y = (float(j) - p.corr_lo) / max(0.001, p.corr_hi - p.corr_lo);
        float mix = (1.0 - min(1.0, max(0.0, y))) * p.ext_factor;
        theta = theta * (1.0 - mix) + (float(ps) * fb) * mix;
    }
    theta = reduce_2pi(theta);
    float cs = cos(theta) * p.mscale;
    float sn = sin(theta) * p.mscale;
#else
    float freq = p.freq_scale * exp2(float(j) * p.theta_log2);
    if (p.has_ff != 0u) {
        freq /= ff[j];
    }
    float theta = reduce_2pi(float(ps) * freq);
    float cs = cos(theta);
    float sn = sin(theta);
#endif
    float x0 = uintBitsToFloat(k[kb + c0]);
    float x1 = uintBitsToFloat(k[kb + c1]);
    return second ? x0 * sn + x1 * cs : x0 * cs - x1 * sn;
}
#endif

void main() {
    bool is_v = gl_WorkGroupID.z == 1u;
    uint cstep = gl_NumWorkGroups.x * 256u;
    for (uint t = gl_WorkGroupID.y; t < p.n_tokens; t += gl_NumWorkGroups.y) {
        int ps = pos[p.pos_off + t];
        if (ps < 0 || uint(ps) >= p.n_ctx) {
            continue;
        }
        uint dst = uint(ps) * p.row_len;
        for (uint c = gl_GlobalInvocationID.x; c < p.row_len; c += cstep) {
            if (is_v) {
                vc[p.vc_off + dst + c] = uint16_t(f32_to_f16_bits(v[p.v_off + t * p.v_stride + c]));
            } else {
#if ROPE
                float kv = roped_k(p.k_off + t * p.k_stride, c, ps);
                kc[p.kc_off + dst + c] = uint16_t(f32_to_f16_bits(floatBitsToUint(kv)));
#else
                kc[p.kc_off + dst + c] = uint16_t(f32_to_f16_bits(k[p.k_off + t * p.k_stride + c]));
#endif
            }
        }
    }
}
