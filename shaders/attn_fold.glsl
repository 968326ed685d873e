// attn_fold.glsl: attention.comp's FOLD (see there for the scheme and its memory ordering):
// the counters, the "last split" test and the merge of attn_combine.glsl. Included by both
// paths after their declarations (push constants `p`, the partials `part`) and these of the
// merge's shared storage: CB_WS, CB_WGET, CB_WSET, CB_YGET, CB_YSET.

#ifndef FOLD_KEEP_COUNT
#define FOLD_KEEP_COUNT 0  // 1: never reset the counter (a deliberately broken kernel for the tests)
#endif

layout(std430, binding = 6) coherent buffer Cnt { uint cnt[]; };
#if Q8
layout(std430, binding = 7) writeonly buffer XQ { uint xq[]; };
layout(std430, binding = 7) writeonly buffer XQM { uvec2 xqm[]; };
#define Q8_WG 128u
#include "q8_1.glsl"
#endif

shared uint s_last;  // whether this workgroup wrote its block's last split
uint fold_r0, fold_g, fold_grp;

// the row (t * n_heads + h) of the block's r-th row
uint cb_row(uint r) {
    const uint rr = fold_r0 + r;
    const uint t = rr / fold_grp;
    return t * p.n_heads + fold_g * fold_grp + (rr - t * fold_grp);
}

void o_store(uint row, uint d, float y) {
    const uint t = row / p.n_heads;
    o[p.o_off + t * p.o_stride + (row - t * p.n_heads) * p.hd + d] = y;
}

#define CB_NT 128u
#define CB_U 4u
#define CB_UNR 8u
#if Q8
#define CB_OUT(r, row, d, y) o_store(row, d, y); CB_YSET((r) * p.hd + (d), y)
#else
#define CB_OUT(r, row, d, y) o_store(row, d, y)
#endif
#include "attn_combine.glsl"

// After the workgroup wrote its partial: count it done; the last split's workgroup merges the
// block's nr rows (r0: the block's first row, g: its kv head, grp: heads per kv head).
void fold(uint tid, uint r0, uint g, uint grp, uint nr) {
    controlBarrier(gl_ScopeWorkgroup, gl_ScopeDevice, gl_StorageSemanticsBuffer | gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);  // every invocation's partial writes, before the increment
    if (tid == 0u) {
        const uint c = gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y;
        const uint before = atomicAdd(cnt[c], 1u, gl_ScopeDevice, gl_StorageSemanticsBuffer, gl_SemanticsAcquireRelease);
        const bool last = before == p.n_splits - 1u;
#if !FOLD_KEEP_COUNT
        if (last) {
            cnt[c] = 0u;  // every split has counted: nothing else touches it in this dispatch
        }
#endif
        s_last = last ? 1u : 0u;
    }
    controlBarrier(gl_ScopeWorkgroup, gl_ScopeDevice, gl_StorageSemanticsBuffer | gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease);  // the increment's acquire, to every invocation
    if (s_last == 0u) {
        return;
    }
    fold_r0 = r0;
    fold_g = g;
    fold_grp = grp;
    const uint n_rows = p.n_tokens * p.n_heads;
    const uint mlb = p.n_splits * n_rows * p.hd;
    cb_weights(tid, nr, p.n_splits, n_rows, mlb);
    cb_output(tid, nr, p.n_splits, n_rows, mlb, p.hd);
#if Q8
    cb_q8(tid, nr, p.hd, n_rows * p.hd / 32u);
#endif
}
