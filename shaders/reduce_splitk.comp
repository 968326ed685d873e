#version 450
// reduce_splitk_f32: y[m, c0 + n] = sum over z < S of part[z][m][n], the partial products of a
// split-K cooperative-matrix mat-mul (mul_mat_coopmat.comp with ksplit > 0), in a fixed order
// (z = 0, 1, ...): the result does not depend on scheduling.
//
// part: S x M x N f32, compact (row stride N). Push constants: M, N, S, y_stride, y_offset,
// y_col0. Workgroups: (min(ceil(M N / 256), 65535), rows of that), 256 invocations each.
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer P { float part[]; };
layout(std430, binding = 1) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M; uint N; uint S; uint y_stride; uint y_offset; uint y_col0;
} p;

void main() {
    const uint i = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * 256u;
    const uint mn = p.M * p.N;
    if (i >= mn) {
        return;
    }
    float s = part[i];
    for (uint z = 1u; z < p.S; ++z) {
        s += part[z * mn + i];
    }
    const uint m = i / p.N;
    y[p.y_offset + m * p.y_stride + p.y_col0 + (i - m * p.N)] = s;
}
