#version 450
// add_f32, mul_f32, scale_f32, silu_f32, gelu_f32, swiglu_f32: elementwise ops over the rows of
// a 2-D f32 tensor. Every operand is (element offset, row stride in elements); the kernel
// handles any row length. OP: 0 add, 1 mul, 2 scale, 3 silu, 4 gelu (tanh approximation, as
// ggml), 5 swiglu (a = gate, b = up: silu(gate) * up), 6 geglu (gelu(gate) * up), 7 softcap
// (scale * tanh(x / scale): a final-logit soft cap, scale = the cap). The binary ops read b's row
// (row % b_rows): b_rows = 1 broadcasts one row vector over every row of a.
// In-place use (d aliasing a or b, same offset and stride) is allowed: every element is read
// before it is written by the same invocation, and no other invocation touches it.

layout(local_size_x = 256) in;

#define BINARY (OP == 0 || OP == 1 || OP == 5 || OP == 6)

layout(std430, binding = 0) readonly buffer A { float a[]; };
#if BINARY
layout(std430, binding = 1) readonly buffer B { float b[]; };
layout(std430, binding = 2) writeonly buffer Dst { float d[]; };
#else
layout(std430, binding = 1) writeonly buffer Dst { float d[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;
    uint nrows;
    uint a_off;
    uint a_stride;
    uint b_off;
    uint b_stride;
    uint b_rows;
    uint d_off;
    uint d_stride;
    float scale;
} p;

float silu(float x) { return x / (1.0 + exp(-x)); }

float gelu(float x) {
    // 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))), tanh(v) written as 1 - 2/(e^2v + 1)
    // so that large |v| saturates instead of giving inf/inf.
    const float GELU_COEF_A = 0.044715;
    const float SQRT_2_OVER_PI = 0.79788456080286535587989211986876;
    float v = SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x);
    return 0.5 * x * (2.0 - 2.0 / (exp(2.0 * v) + 1.0));
}

void main() {
    uint cstep = gl_NumWorkGroups.x * 256u;
    for (uint row = gl_WorkGroupID.y; row < p.nrows; row += gl_NumWorkGroups.y) {
        uint ab = p.a_off + row * p.a_stride;
        uint db = p.d_off + row * p.d_stride;
#if BINARY
        uint bb = p.b_off + (row % p.b_rows) * p.b_stride;
#endif
        for (uint c = gl_GlobalInvocationID.x; c < p.ncols; c += cstep) {
            float x = a[ab + c];
#if OP == 0
            float y = x + b[bb + c];
#elif OP == 1
            float y = x * b[bb + c];
#elif OP == 2
            float y = x * p.scale;
#elif OP == 3
            float y = silu(x);
#elif OP == 4
            float y = gelu(x);
#elif OP == 5
            float y = silu(x) * b[bb + c];
#elif OP == 6
            float y = gelu(x) * b[bb + c];
#elif OP == 7
            // tanh(v) = 1 - 2/(e^2v + 1): saturates for large |v| instead of giving inf/inf
            float y = p.scale * (1.0 - 2.0 / (exp(2.0 * x / p.scale) + 1.0));
#endif
            d[db + c] = y;
        }
    }
}
