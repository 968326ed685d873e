#version 450
// wait_flag: one invocation polls the word flag[0] (written by another agent: a CUDA stream's
// cuStreamWriteValue32, the host) until it is >= target[0], at most max_spins times; then
// result[0] = the polls taken, or 0xFFFFFFFF when it gave up. A GPU-side wait on memory, the
// Vulkan half of a hand-off by memory flag (tools/bench_handoff.py); bounded, so a flag never
// written cannot hang the queue. target is read from a buffer so a recorded sequence can be
// replayed with a new target each time. Each poll is an atomic read (atomicAdd of 0): a plain
// or even volatile load may be hoisted out of the loop (llvmpipe folds the loop away).
layout(local_size_x = 1) in;
layout(std430, binding = 0) coherent buffer Flag { uint flag[]; };
layout(std430, binding = 1) readonly buffer Target { uint target[]; };
layout(std430, binding = 2) writeonly buffer Result { uint result[]; };
layout(push_constant) uniform Push { uint max_spins; } p;

void main() {
    const uint t = target[0];
    uint n = 0u;
    uint v = atomicAdd(flag[0], 0u);
    while (v < t && n < p.max_spins) {
        n++;
        v = atomicAdd(flag[0], 0u);
    }
    result[0] = v >= t ? n : 0xFFFFFFFFu;
}
