#version 450
// probe_*: kernels that measure the device rather than compute an op (tools/probes.py,
// tools/bench_kernels.py). Each answers "how fast can one launch of this kind be at all on this
// device and driver", the ceiling a real kernel of the library is read against.
//
// PROBE 1, probe_read_u<U>: read n uvec4 (16-byte loads, a warp's loads contiguous, U loads
// issued per thread before any is used) and add every 32-bit word (wrapping) into the word of
// the workgroup: out[w] for workgroup w, their sum the sum of all words. A mat-vec reads its
// weights and writes almost nothing, so a read-only launch of the same bytes is its ceiling (a
// copy also writes half its traffic).
// Push: n (uvec4s), passes (times the grid reads the buffer, each workgroup another's chunks
// each pass; the sums count each word that many times). Workgroups: any count; workgroup w
// reads chunks w, w + groups, ... of WG U uvec4s.
//
// PROBE 2, probe_mma_f16_sg: subgroup-scope (VK_KHR_cooperative_matrix) f16 x f16 -> f32
// 16 x 16 x 16 multiply-adds on operands loaded once: FM fragments of A and FN of B per
// subgroup, iters rounds of the FM x FN products, no memory traffic in the loop: the matrix
// units' rate as this driver issues them. out[subgroup][i][j] = iters (A_i B_j).
// Push: iters. Operands: a (FM 16 x 16 f16, row-major), b (FN 16 x 16 f16, row-major).
//
// PROBE 3, probe_mma_f16_wg_w<BW>x<BX>_k<BK>_n<NT>: the same at workgroup scope
// (VK_NV_cooperative_matrix2), the tile mul_mat_cm2.comp multiplies per K step: A = BW x BK,
// B = BK x BX, the BW x BX accumulator; the loop runs what mul_mat_cm2's K loop runs less
// its two loads. out[workgroup] = iters (A B), row-major BW x BX.
#extension GL_EXT_control_flow_attributes : require
#if PROBE == 1
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_basic : require
#else
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#if PROBE == 3
#extension GL_NV_cooperative_matrix2 : require
#endif
#endif

#ifndef WG
#define WG 256
#endif
layout(local_size_x = WG) in;

#if PROBE == 1
#ifndef U
#define U 4
#endif
layout(std430, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(std430, binding = 1) writeonly buffer Out { uint out_sum[]; };
layout(push_constant) uniform Push { uint n, passes; } p;
shared uint part[WG];

void main() {
    const uint chunk = WG * U;
    uint s = 0u;
    // passes > 1: the workgroup reads again, each pass the chunks of another workgroup (97
    // further on, or 1 where the grid is a multiple of 97; a shift: every chunk still read once
    // per pass), likely run by another multiprocessor, so not served from this one's L1 (not
    // measured); a buffer that fits in L2 then measures the L2's rate rather than one launch's
    // fixed cost
    const uint G = gl_NumWorkGroups.x;
    const uint step = (97u % G) == 0u ? 1u : 97u;
    for (uint pass = 0u; pass < p.passes; ++pass)
    for (uint base = ((gl_WorkGroupID.x + step * pass) % G) * chunk; base < p.n; base += G * chunk) {
        uvec4 v[U];
        [[unroll]] for (uint u = 0u; u < U; ++u) {
            const uint i = base + u * WG + gl_LocalInvocationID.x;
            v[u] = i < p.n ? src[i] : uvec4(0u);
        }
        [[unroll]] for (uint u = 0u; u < U; ++u) {
            s += v[u].x + v[u].y + v[u].z + v[u].w;
        }
    }
    // one word per workgroup, no atomics: one atomic per subgroup into a single word
    // serialises at that word (on the H200 it made a large read slower than a mat-vec)
    s = subgroupAdd(s);
    if (subgroupElect()) {
        part[gl_SubgroupID] = s;
    }
    barrier();
    if (gl_LocalInvocationID.x == 0u) {
        uint t = 0u;
        for (uint i = 0u; i < gl_NumSubgroups; ++i) {
            t += part[i];
        }
        out_sum[gl_WorkGroupID.x] = t;
    }
}

#elif PROBE == 2
#ifndef FM
#define FM 2
#endif
#ifndef FN
#define FN 4
#endif
layout(std430, binding = 0) readonly buffer A { float16_t a_src[]; };
layout(std430, binding = 1) readonly buffer B { float16_t b_src[]; };
layout(std430, binding = 2) writeonly buffer Out { float out_c[]; };
layout(push_constant) uniform Push { uint iters; } p;

void main() {
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a[FM];
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b[FN];
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> c[FM][FN];
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        coopMatLoad(a[i], a_src, i * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
    }
    [[unroll]] for (uint j = 0u; j < FN; ++j) {
        coopMatLoad(b[j], b_src, j * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
    }
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            c[i][j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
        }
    }
    for (uint it = 0u; it < p.iters; ++it) {
        [[unroll]] for (uint i = 0u; i < FM; ++i) {
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                c[i][j] = coopMatMulAdd(a[i], b[j], c[i][j]);
            }
        }
    }
    const uint sg = gl_WorkGroupID.x * gl_NumSubgroups + gl_SubgroupID;  // (subgroups of 32: COOP_SUBGROUP)
    [[unroll]] for (uint i = 0u; i < FM; ++i) {
        [[unroll]] for (uint j = 0u; j < FN; ++j) {
            coopMatStore(c[i][j], out_c, ((sg * FM + i) * FN + j) * 256u, 16u,
                         gl_CooperativeMatrixLayoutRowMajor);
        }
    }
}

#elif PROBE == 3
#ifndef BW
#define BW 128
#endif
#ifndef BX
#define BX 128
#endif
#ifndef BK
#define BK 64
#endif
layout(std430, binding = 0) readonly buffer A { float16_t a_src[]; };
layout(std430, binding = 1) readonly buffer B { float16_t b_src[]; };
layout(std430, binding = 2) writeonly buffer Out { float out_c[]; };
layout(push_constant) uniform Push { uint iters; } p;

void main() {
    coopmat<float16_t, gl_ScopeWorkgroup, BW, BK, gl_MatrixUseA> a;
    coopmat<float16_t, gl_ScopeWorkgroup, BK, BX, gl_MatrixUseB> b;
    coopmat<float, gl_ScopeWorkgroup, BW, BX, gl_MatrixUseAccumulator> c =
        coopmat<float, gl_ScopeWorkgroup, BW, BX, gl_MatrixUseAccumulator>(0.0);
    coopMatLoad(a, a_src, 0u, BK, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(b, b_src, 0u, BX, gl_CooperativeMatrixLayoutRowMajor);
    for (uint it = 0u; it < p.iters; ++it) {
        c = coopMatMulAdd(a, b, c);
    }
    coopMatStore(c, out_c, gl_WorkGroupID.x * (BW * BX), BX, gl_CooperativeMatrixLayoutRowMajor);
}
#endif
