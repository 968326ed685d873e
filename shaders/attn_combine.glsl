// attn_combine.glsl: the merge of attention's KV splits (attention.comp's `part` layout):
//   out[row, :] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s,  M = max_s m_s,
// for nr rows at once: attn_combine.comp merges one row per workgroup, attention.comp with
// FOLD the rows of its block in the workgroup that wrote the block's last split. Both run
// these functions, so they give the same bits: every sum has a fixed order that depends on
// neither the number of rows, the invocation doing it nor the subgroup size:
//   L    = sum over lanes j = 0 .. CB_LANES - 1 of (sum over s = j, j + CB_LANES, ... of l_s w_s)
//   a[d] = sum over s = 0 .. S - 1 of O_s[d] w_s,  y[d] = a[d] * (L > 0 ? 1 / L : 0)
// with w_s = e^(m_s - M), and `precise` keeps the compiler from contracting or reassociating
// them differently in the two kernels.
//
// Before including:
//   CB_NT            the workgroup size (CB_ROWS = CB_NT / CB_LANES rows at most per call)
//   part[]           the partials (readable)
//   CB_WS            weights kept in shared memory per row (past it: recomputed, same bits)
//   CB_WGET(i), CB_WSET(i, v)  that storage, CB_ROWS * CB_WS floats
//   CB_U, CB_UNR     output elements per invocation and splits per batch of loads: each
//                    invocation has CB_U * CB_UNR loads in flight (the order of each sum stays)
//   CB_OUT(r, row, d, y)       stores output element d of the r-th row handled
//   uint cb_row(uint r)        the row (t * n_heads + h) of the r-th row handled
// With Q8: CB_YGET(i) (the outputs as CB_OUT staged them, r * D + d) and q8_1.glsl included.
// Every function has barriers: call them from uniform control flow.

#define CB_LANES 8u
#define CB_ROWS (CB_NT / CB_LANES)

shared float cb_mx[CB_NT];    // per-lane maxima, then per-lane sums
shared float cb_rm[CB_ROWS];  // M of each row
shared float cb_ri[CB_ROWS];  // 1 / L of each row (0 when L = 0)

// M, L and the split weights of rows 0 .. nr - 1 (nr <= CB_ROWS): CB_LANES invocations a row.
// mlb: where the (max, sum) pairs start in part[].
void cb_weights(uint tid, uint nr, uint S, uint n_rows, uint mlb) {
    const uint r = tid / CB_LANES;
    const uint j = tid - r * CB_LANES;
    const bool act = r < nr;
    const uint row = act ? cb_row(r) : 0u;
    const uint step = CB_LANES * 4u;
    float m = -3.0e38;
    if (act) {
        uint s = j;
        for (; s + 3u * CB_LANES < S; s += step) {  // four loads in flight
            float v[4];
            [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                v[k] = part[mlb + ((s + k * CB_LANES) * n_rows + row) * 2u];
            }
            m = max(m, max(max(v[0], v[1]), max(v[2], v[3])));
        }
        for (; s < S; s += CB_LANES) {
            m = max(m, part[mlb + (s * n_rows + row) * 2u]);
        }
    }
    cb_mx[tid] = m;
    barrier();
    float M = -3.0e38;
    [[unroll]] for (uint i = 0u; i < CB_LANES; ++i) {
        M = max(M, cb_mx[(act ? r : 0u) * CB_LANES + i]);
    }
    barrier();  // cb_mx is reused for the sums
    precise float l = 0.0;
    if (act) {
        uint s = j;
        for (; s + 3u * CB_LANES < S; s += step) {
            vec2 v[4];
            [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                const uint b = mlb + ((s + k * CB_LANES) * n_rows + row) * 2u;
                v[k] = vec2(part[b], part[b + 1u]);
            }
            [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                const uint sk = s + k * CB_LANES;
                const float e = exp(v[k].x - M);
                l += v[k].y * e;
                if (sk < CB_WS) {
                    CB_WSET(r * CB_WS + sk, e);
                }
            }
        }
        for (; s < S; s += CB_LANES) {
            const uint b = mlb + (s * n_rows + row) * 2u;
            const float e = exp(part[b] - M);
            l += part[b + 1u] * e;
            if (s < CB_WS) {
                CB_WSET(r * CB_WS + s, e);
            }
        }
    }
    cb_mx[tid] = l;
    barrier();
    if (act && j == 0u) {
        precise float L = 0.0;
        [[unroll]] for (uint i = 0u; i < CB_LANES; ++i) {
            L += cb_mx[r * CB_LANES + i];
        }
        cb_rm[r] = M;
        cb_ri[r] = L > 0.0 ? 1.0 / L : 0.0;
    }
    barrier();  // M, 1 / L and the weights are in
}

// w_s of the r-th row (its row index `row`)
float cb_w(uint r, uint s, uint row, uint n_rows, uint mlb) {
    return s < CB_WS ? CB_WGET(r * CB_WS + s) : exp(part[mlb + (s * n_rows + row) * 2u] - cb_rm[r]);
}

// the outputs of rows 0 .. nr - 1 (after cb_weights): CB_U consecutive elements of a row per
// invocation and step, the splits' partials loaded CB_UNR splits at a time, all before the
// first use, summed in split order
void cb_output(uint tid, uint nr, uint S, uint n_rows, uint mlb, uint D) {
    const uint DU = (D + CB_U - 1u) / CB_U;
    for (uint u = tid; u < nr * DU; u += CB_NT) {
        const uint r = u / DU;
        const uint d0 = (u - r * DU) * CB_U;
        const uint row = cb_row(r);
        precise float a[CB_U];
        [[unroll]] for (uint e = 0u; e < CB_U; ++e) {
            a[e] = 0.0;
        }
        uint s = 0u;
        for (; s + CB_UNR <= S; s += CB_UNR) {
            float v[CB_UNR * CB_U];
            [[unroll]] for (uint k = 0u; k < CB_UNR; ++k) {
                [[unroll]] for (uint e = 0u; e < CB_U; ++e) {
                    v[k * CB_U + e] = d0 + e < D ? part[((s + k) * n_rows + row) * D + d0 + e] : 0.0;
                }
            }
            [[unroll]] for (uint k = 0u; k < CB_UNR; ++k) {
                const float w = cb_w(r, s + k, row, n_rows, mlb);
                [[unroll]] for (uint e = 0u; e < CB_U; ++e) {
                    a[e] += v[k * CB_U + e] * w;
                }
            }
        }
        for (; s < S; s++) {
            const float w = cb_w(r, s, row, n_rows, mlb);
            [[unroll]] for (uint e = 0u; e < CB_U; ++e) {
                a[e] += (d0 + e < D ? part[(s * n_rows + row) * D + d0 + e] : 0.0) * w;
            }
        }
        const float inv = cb_ri[r];
        [[unroll]] for (uint e = 0u; e < CB_U; ++e) {
            if (d0 + e < D) {
                CB_OUT(r, row, d0 + e, a[e] * inv);
            }
        }
    }
}

#if Q8
// the outputs of rows 0 .. nr - 1 (staged by CB_OUT) also as q8_1 blocks of the x of the next
// product: rows of n_heads * D elements (contiguous), 32-element blocks (D % 32 == 0, so none
// straddles two rows); four consecutive elements per invocation, 8 invocations per block.
// nblk: the blocks of the whole output (where the scales start).
void cb_q8(uint tid, uint nr, uint D, uint nblk) {
    barrier();  // the staged outputs are complete
    const uint n = nr * D;
    for (uint c0 = 0u; c0 < n; c0 += 4u * CB_NT) {  // uniform: q8_1_store has barriers
        const uint e = c0 + 4u * tid;
        const bool live = e < n;
        const uint r = live ? e / D : 0u;
        const uint c = e - r * D;
        uint u[4];
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
            u[i] = live ? floatBitsToUint(CB_YGET(e + i)) : 0u;  // the bits written are the bits quantized
        }
        q8_1_store(tid, (cb_row(r) * D + c) >> 5, nblk, live, u);
    }
}
#endif
