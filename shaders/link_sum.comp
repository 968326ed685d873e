#version 450
// link_sum: dst = a + peer over n vec4s, where peer lies in host pages another device wrote
// (the second half of a two-device all-reduce, vkxsplit/ops/link.py). peer is read with
// volatile loads: a line this device read at an earlier use of the same pages may still sit in
// its caches, and no Vulkan barrier orders another device's writes.
layout(local_size_x = 256) in;
layout(std430, binding = 0) readonly buffer A { vec4 a[]; };
layout(std430, binding = 1) volatile readonly buffer Peer { vec4 peer[]; };
layout(std430, binding = 2) writeonly buffer Dst { vec4 dst[]; };
layout(push_constant) uniform Push { uint n; } p;

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        dst[i] = a[i] + peer[i];
    }
}
