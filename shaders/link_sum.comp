#version 450
// link_sum: dst = a + peer over n vec4s, where peer lies in host pages another device wrote
// (the second half of a two-device all-reduce, vkxsplit/ops/link.py). peer is read with
// volatile loads: a line this device read at an earlier use of the same pages may still sit in
// its caches, and no Vulkan barrier orders another device's writes.
// PARTS_F16 / PARTS_BF16: a and peer hold f16 / bf16 (both rounded by the same convert kernel
// on each device, so both devices add the same two floats); dst stays f32 (the sum is taken in
// f32: a bf16 value widens to f32 exactly, its 16 bits the high half of the f32's).
layout(local_size_x = 256) in;
#if defined(PARTS_BF16)
layout(std430, binding = 0) readonly buffer A { uvec2 a[]; };
layout(std430, binding = 1) volatile readonly buffer Peer { uvec2 peer[]; };
// element 2i is the low half of word i (little-endian), element 2i + 1 the high half
#define BF2(w) uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u)
#define LOAD(arr, i) vec4(BF2(arr[i].x), BF2(arr[i].y))
#elif defined(PARTS_F16)
layout(std430, binding = 0) readonly buffer A { uvec2 a[]; };
layout(std430, binding = 1) volatile readonly buffer Peer { uvec2 peer[]; };
#define LOAD(arr, i) vec4(unpackHalf2x16(arr[i].x), unpackHalf2x16(arr[i].y))
#else
layout(std430, binding = 0) readonly buffer A { vec4 a[]; };
layout(std430, binding = 1) volatile readonly buffer Peer { vec4 peer[]; };
#define LOAD(arr, i) arr[i]
#endif
layout(std430, binding = 2) writeonly buffer Dst { vec4 dst[]; };
layout(push_constant) uniform Push { uint n; } p;

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        dst[i] = LOAD(a, i) + LOAD(peer, i);
    }
}
