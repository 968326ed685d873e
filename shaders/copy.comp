#version 450
// copy_vec4: dst[i] = src[i] for n 16-byte vectors (bandwidth reference and plain copies).
layout(local_size_x = 256) in;
layout(std430, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(std430, binding = 1) writeonly buffer Dst { uvec4 dst[]; };
layout(push_constant) uniform Push { uint n; } p;

void main() {
    uint stride = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        dst[i] = src[i];
    }
}
