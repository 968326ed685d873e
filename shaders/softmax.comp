#version 450
// softmax_f32 / softmax_mask_f32: y = softmax(x * scale + mask) over each row of a 2-D f32
// tensor. The mask (HAS_MASK = 1) is an additive f32 tensor of m_rows rows; row r of x uses
// mask row r % m_rows (m_rows = 1 broadcasts one row). Numerically stable: every invocation
// keeps an online (max, sum of exp(v - max)) over its columns, the workgroup merges them, and a
// second pass writes exp(v - max) / sum. -inf entries (masked out) give 0; a row that is -inf
// everywhere gives all zeros. One workgroup per row; in-place use (dst == x) is allowed.

layout(local_size_x = 256) in;
#define WG 256u
#define NEG_MAX -3.402823466e38

layout(std430, binding = 0) readonly buffer X { float x[]; };
#if HAS_MASK
layout(std430, binding = 1) readonly buffer M { float mask[]; };
layout(std430, binding = 2) writeonly buffer Dst { float d[]; };
#else
layout(std430, binding = 1) writeonly buffer Dst { float d[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;
    uint nrows;
    uint x_off;
    uint x_stride;
    uint m_off;
    uint m_stride;
    uint m_rows;
    uint d_off;
    uint d_stride;
    float scale;
} p;

shared float red_m[WG];
shared float red_s[WG];

void main() {
    uint tid = gl_LocalInvocationID.x;
    for (uint row = gl_WorkGroupID.x; row < p.nrows; row += gl_NumWorkGroups.x) {
        uint xb = p.x_off + row * p.x_stride;
        uint db = p.d_off + row * p.d_stride;
#if HAS_MASK
        uint mb = p.m_off + (row % p.m_rows) * p.m_stride;
#endif
        float m = NEG_MAX;  // finite, so that exp(m - m) never meets inf - inf
        float s = 0.0;
        for (uint c = tid; c < p.ncols; c += WG) {
            float v = x[xb + c] * p.scale;
#if HAS_MASK
            v += mask[mb + c];
#endif
            if (v > m) {
                s = s * exp(m - v) + 1.0;
                m = v;
            } else if (v > NEG_MAX) {
                s += exp(v - m);
            }
        }
        red_m[tid] = m;
        red_s[tid] = s;
        barrier();
        for (uint k = WG / 2u; k > 0u; k >>= 1) {
            if (tid < k) {
                float m1 = red_m[tid];
                float m2 = red_m[tid + k];
                float mm = max(m1, m2);
                red_s[tid] = red_s[tid] * exp(m1 - mm) + red_s[tid + k] * exp(m2 - mm);
                red_m[tid] = mm;
            }
            barrier();
        }
        float rmax = red_m[0];
        float rsum = red_s[0];
        float inv = rsum > 0.0 ? 1.0 / rsum : 0.0;
        barrier();  // red_*[] are reused by the next row
        for (uint c = tid; c < p.ncols; c += WG) {
            float v = x[xb + c] * p.scale;
#if HAS_MASK
            v += mask[mb + c];
#endif
            d[db + c] = v > NEG_MAX ? exp(v - rmax) * inv : 0.0;
        }
    }
}
