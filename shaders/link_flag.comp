#version 450
// link_flag: the GPU-side rendezvous of a cross-device link (tools/flags.py). Two
// devices (two GPUs, or two VkDevices) import the same host pages; each owns one flag word
// there and only ever writes that one. One invocation:
//   mode & 1 (signal): mine[0] = base[0] + offset  (after a barrier that made this device's
//                      data writes available to the host domain, i.e. out of its caches)
//   mode & 2 (wait):   poll peer[0] until it has reached base[0] + offset (wrap-safe: the
//                      flags only grow), at most max_spins polls (rounded up to 64).
// mode & 4 (final): this dispatch is the last of the wait's repeats (a wait recorded as several
// dispatches where a driver bounds every shader's loops: llvmpipe ends them after 65535
// iterations in all). A final wait that gives up writes its target to status[0] and every later wait of the same step
// returns at once (status[0] != 0): a dead peer costs one bounded wait, not one per link; the
// host reads status after the step and raises. status[1] counts the polls (how long waits were).
// Polls: POLL_ATOMIC reads with atomicAdd(x, 0) (llvmpipe hoists a volatile load out of the
// loop); otherwise a volatile load (a system-scope load on NVIDIA: not served from a cache).
layout(local_size_x = 1) in;
#ifdef POLL_ATOMIC
layout(std430, binding = 0) coherent buffer Peer { uint peer[]; };
#define POLL() atomicAdd(peer[0], 0u)
#else
layout(std430, binding = 0) volatile buffer Peer { uint peer[]; };
#define POLL() peer[0]
#endif
layout(std430, binding = 1) volatile buffer Mine { uint mine[]; };
layout(std430, binding = 2) readonly buffer Base { uint base[]; };
layout(std430, binding = 3) coherent buffer Status { uint status[]; };
layout(push_constant) uniform Push { uint offset; uint max_spins; uint mode; } p;

void main() {
    const uint t = base[0] + p.offset;
    if ((p.mode & 1u) != 0u) {
        mine[0] = t;
    }
    if ((p.mode & 2u) != 0u) {
        if (status[0] != 0u) {
            return;
        }
        // polls in rounds of 64: llvmpipe ends any one loop after 65535 iterations
        uint n = 0u;
        uint v = POLL();
        while (int(v - t) < 0 && n < p.max_spins) {
            for (uint k = 0u; k < 64u && int(v - t) < 0; k++) {
                v = POLL();
            }
            n += 64u;
        }
        status[1] += n;
        if (int(v - t) < 0 && (p.mode & 4u) != 0u) {
            status[0] = t == 0u ? 0xFFFFFFFFu : t;
        }
    }
}
