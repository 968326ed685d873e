#version 450
// moe_group: the (token, slot) pairs of a routed product grouped by expert, for the tiled
// mul_mat_id (shaders/mul_mat_id.comp, VEC = 0), as ggml-vulkan groups rows by expert.
// One workgroup. In: ids (T * n_used int32, pair p = t * n_used + s). Out, u32 words:
//   counts[n_expert + 1]    pairs routed to each expert; the last bucket holds ids outside
//                           [0, n_expert) (the product writes NaN rows for them)
//   offsets[n_expert + 1]   exclusive prefix sums of counts
//   n_tiles                 the tiles below in use
//   tiles[2 * max_tiles]    (bucket, first row within the bucket), one per BM rows of a bucket
//   rows[P]                 pair indices, bucket by bucket (within a bucket in no set order:
//                           every pair's row of y is computed on its own, so order is moot)
// max_tiles = P / BM + min(n_expert + 1, P) + 1 (integer division), a bound on
// sum_e ceil(count_e / BM). Push constants: P, n_expert, BM.
#extension GL_EXT_control_flow_attributes : require

#define WG 256u
#ifndef MAXE
#define MAXE 512u
#endif
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Ids { int ids[]; };
layout(std430, binding = 1) buffer Groups { uint grp[]; };

layout(push_constant) uniform Push { uint P; uint n_expert; uint BM; } p;

shared uint cnt[MAXE + 1u];
shared uint cur[MAXE + 1u];
shared uint off[MAXE + 1u];

uint bucket(int e) { return (e < 0 || uint(e) >= p.n_expert) ? p.n_expert : uint(e); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint ne = p.n_expert;
    for (uint e = tid; e <= ne; e += WG) {
        cnt[e] = 0u;
        cur[e] = 0u;
    }
    barrier();
    for (uint i = tid; i < p.P; i += WG) {
        atomicAdd(cnt[bucket(ids[i])], 1u);
    }
    barrier();
    if (tid == 0u) {
        uint acc = 0u;
        uint nt = 0u;
        const uint tiles0 = 2u * ne + 3u;
        for (uint e = 0u; e <= ne; ++e) {
            off[e] = acc;
            grp[e] = cnt[e];
            grp[ne + 1u + e] = acc;
            acc += cnt[e];
            for (uint r = 0u; r < cnt[e]; r += p.BM) {
                grp[tiles0 + 2u * nt] = e;
                grp[tiles0 + 2u * nt + 1u] = r;
                nt += 1u;
            }
        }
        grp[2u * ne + 2u] = nt;
    }
    barrier();
    const uint rows0 = 2u * ne + 3u + 2u * (p.P / p.BM + min(ne + 1u, p.P) + 1u);
    for (uint i = tid; i < p.P; i += WG) {
        const uint b = bucket(ids[i]);
        const uint slot = atomicAdd(cur[b], 1u);
        grp[rows0 + off[b] + slot] = i;
    }
}
