#version 450
// probe_rows_v<V>_wg<WG>_nr<NR>_r<R>_u<U>: a probe (tools/probes.py, tools/bench_kernels.py;
// shaders/probe.comp holds the others), a read-only launch in a decode kernel's grid: rows of
// row_words 32-bit words (a weight row's bytes), a workgroup of WG threads on row groups
// of NR R rows (row g NR R + t + NR i for team t < NR, i < R, as mul_mat_vecq's RPT rows), team t
// the L = WG / NR contiguous threads tid / L == t, each loading V-word units lane, lane + L, ...
// of its R rows, U units per row issued before any is used; the sums reduced per row (a
// subgroupAdd per team and row, shared atomics over subgroups) and stored, out[row] = the
// wrapping sum of the row's words. What it says: whether a mat-vec's grid (short chains, every
// workgroup reducing and storing at its end) reaches the read-only ceiling when its loads are
// coalesced; the decode kernel's own loads, in the same grid, are probe_vecq_noc.
// Push: rows, row_words (a multiple of V). Workgroups: any count; workgroup w takes row groups w,
// w + groups, ...
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_basic : require

#ifndef WG
#define WG 128
#endif
layout(local_size_x = WG) in;

#ifndef V
#define V 4
#endif
#ifndef NR
#define NR 1
#endif
#ifndef R
#define R 2
#endif
#ifndef U
#define U 2
#endif
#if WG % NR != 0
#error "WG must be a multiple of NR"
#endif
#define L (WG / NR)
#if V == 4
layout(std430, binding = 0) readonly buffer Src { uvec4 src[]; };
#define UNIT uvec4
#define WSUM(v) ((v).x + (v).y + (v).z + (v).w)
#elif V == 1
layout(std430, binding = 0) readonly buffer Src { uint src[]; };
#define UNIT uint
#define WSUM(v) (v)
#else
#error "V: 1 or 4"
#endif
layout(std430, binding = 1) writeonly buffer Out { uint out_sum[]; };
layout(push_constant) uniform Push { uint rows, row_words; } p;
shared uint red[NR * R];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint team = tid / L;
    const uint lane = tid % L;
    const uint units = p.row_words / V;  // V-word units per row
    const uint ngroups = (p.rows + NR * R - 1u) / (NR * R);
    for (uint g = gl_WorkGroupID.x; g < ngroups; g += gl_NumWorkGroups.x) {
        if (tid < NR * R) {
            red[tid] = 0u;
        }
        barrier();
        uint row[R];
        uint s[R];
        [[unroll]] for (uint i = 0u; i < R; ++i) {
            row[i] = g * (NR * R) + team + NR * i;
            s[i] = 0u;
        }
        for (uint b = lane; b < units; b += L * U) {
            UNIT v[R][U];
            [[unroll]] for (uint i = 0u; i < R; ++i) {
                [[unroll]] for (uint u = 0u; u < U; ++u) {
                    const uint k = b + u * L;
                    v[i][u] = row[i] < p.rows && k < units ? src[row[i] * units + k] : UNIT(0u);
                }
            }
            [[unroll]] for (uint i = 0u; i < R; ++i) {
                [[unroll]] for (uint u = 0u; u < U; ++u) {
                    s[i] += WSUM(v[i][u]);
                }
            }
        }
        // per team and row: a subgroupAdd over the subgroup's lanes of that team (a subgroup
        // may span teams, any subgroup size), then one shared atomic per subgroup
        [[unroll]] for (uint t = 0u; t < NR; ++t) {
            [[unroll]] for (uint i = 0u; i < R; ++i) {
                const uint v = subgroupAdd(team == t ? s[i] : 0u);
                if (subgroupElect()) {
                    atomicAdd(red[t * R + i], v);
                }
            }
        }
        barrier();
        if (tid < NR * R) {
            const uint r = g * (NR * R) + (tid / R) + NR * (tid % R);
            if (r < p.rows) {
                out_sum[r] = red[tid];
            }
        }
        barrier();
    }
}

