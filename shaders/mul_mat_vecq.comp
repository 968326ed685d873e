#version 450
// mul_mat_vecq_<q4_0|q4_1|q8_0|q4_k|q6_k>_q8_1_m<MAXM>_*: y[m, c0 + n] = sum_b d_w d_x[m, b] * sum_i wq_i xq_i
// for M <= MAXM columns of x quantized to 8-bit blocks by quantize_q8_1.comp (binding 1, its
// scratch layout: 32 int8 per block as two uvec4, then a uvec2 (d bits, integer sum) per
// block), Q4_0 / Q8_0 weights (binding 0). ggml's MMVQ scheme: the weight quants stay 8-bit
// integers, 4 products per packed dot-product instruction, an exact integer sum per block,
// then one float FMA per block with the two scales.
//   Q8_0: s = sum_i q_w,i q_x,i                  (signed x signed bytes)
//   Q4_0: s = sum_i n_i q_x,i - 8 sum_i q_x,i    (nibbles 0..15 are valid signed bytes; the
//                                                 -8 offset via the block sum of x)
//   Q4_1: s = sum_i n_i q_x,i, plus m_w d_x sum_i q_x,i (the block's min through the x sum;
//         20-byte blocks, word-aligned: BLK 1 only)
//   Q4_K: per 32-weight sub-block j of a 256-weight super-block, d sc_j d_x sum n q minus
//         dmin m_j d_x sum q (superblock(); one super-block per load unit: "BLK 1"; with
//         KSUB 4 a quarter super-block per unit, kquarter(): the header and 32 nibble bytes)
//   Q6_K: per 32-weight run of a 256-weight super-block, d d_x (sc_a s_a + sc_b s_b) with s_a,
//         s_b the integer sums of its two 16-weight halves, the 6-bit codes minus 32 as signed
//         bytes (superblock6(); one super-block per load unit: "BLK 1")
//   acc += (d_w * d_x) * float(s)                (|s| < 2^17: exact in f32; Q6_K's
//                                                 sc_a s_a + sc_b s_b < 2^24, exact too)
//
// IDP 1: the packed 4x8 dot products of SPV_KHR_integer_dot_product (OpSDot, or with
// IDP_SAT 1 OpSDotAccSat), declared with GL_EXT_spirv_intrinsics (the GLSL extension
// GL_EXT_integer_dot_product is newer than the glslc / glslang here); needs the device feature
// shaderIntegerDotProduct. IDP 0: the same sums with unpacked bytes and int multiply-adds
// (bitfieldExtract), for devices without it; results are identical.
//
// Layout as mul_mat_vec_wide.comp: a workgroup of WG threads computes NR rows; thread tid
// works on row tid % NR as lane tid / NR of that row's team of L = WG / NR threads (a warp's
// lanes at the same block index read the same x block: broadcast). Lanes take whole weight
// blocks:
//   BLK 8 (K % 256 == 0, 16-byte aligned rows): 8-block groups g = lane, lane + L, ... read
//         with GW (9 / 17) uvec4 loads each (UNR groups per loop iteration), decoded from
//         registers (block b of a group: scale in the low half of a word and quants 2 bytes
//         past a word boundary for even b, scale in a high half and aligned quants for odd b)
//   BLK 1 (any K % 32 == 0): blocks g = lane, lane + L, ... (UNR per iteration), each read
//         with QW 32-bit loads from the word holding its first byte plus two 16-bit loads for
//         its last word (never past the block, so never past the binding), the 2-byte shift
//         selected by the parity of the block's halfword index
// Partial sums are reduced through shared memory (any subgroup size): SG 0, one thread per
// (row, column) adds the L partials of its row in order (L dependent shared loads: ~1 us at
// L = 64 on the H200, paid once by every workgroup at the end); SG 1, subgroupAdd per (row,
// column) over the lanes of that row (the row's team is predicated: r == rr), one partial per
// subgroup to shared memory, then one thread per (row, column) adds gl_NumSubgroups of them.
//
// RPT > 1 (Q4_0 / Q8_0, BLK 1): a thread works on RPT rows (row0 + r + i NR), loading each x
// block once for all of them; a workgroup computes NR RPT rows.
// WLOAD5 1 (Q4_0 / Q8_0, BLK 1): a block's last word as one 32-bit load instead of two 16-bit
// ones (QW + 1 loads per block instead of QW + 2); for a block starting on a word its high half
// is the next block's (unused), so the binding must hold the last row's trailing word (where it
// does not, the host records the same shape without WLOAD5); not bounds-checked here: a check
// per block costs more than the load saves (measured: docs/PERFORMANCE.md, "Decode kernels").
// PROBE_NOX 2 (probe_vecq_noc_*): the RPT > 1 shapes with their weight loads only: no x, each
// block's quant words and scale xor-folded to a byte, y = the row's sum of those bytes.
// Defines: WTYPE (Q4_0, Q4_1, Q8_0, Q4_K or Q6_K), BLK, IDP, IDP_SAT, RPT, SG, KSUB, PROBE_NOX,
// WLOAD5 (what changes the code). Specialization constants: WG (constant_id 0, also the
// workgroup size), NR, UNR, MAXM (shapes of one code path share a module); the host checks
// what the kernel needs of them (WG % NR == 0, NR RPT MAXM <= WG: ops/mul_mat_kernels.py
// make_vecq_variant).
// Push constants as mul_mat_vec.comp (M, N, K, y_stride, y_offset, w_row0, y_col0 used).
// Workgroups: ceil(N / (NR RPT)) folded into (x, y) as x + y * gl_NumWorkGroups.x.
//
// Routed expert product (MUL_MAT_ID=1, MAXM 1: mul_mat_id's decode path, vkxsplit/ops/moe.py):
// workgroup (x, y) computes rows x NR RPT .. of pair y = t n_used + s (no folded grid) of
// expert e = ids[y] (binding 3, int32): W rows e w_rows + w_row0 + n, the q8_1 row t n_xb +
// (n_xb > 1 ? s : 0) of the T n_xb rows quantized into binding 1, y[y y_stride + w_row0 + n].
// An id outside [0, n_expert) writes NaN rows. Push constants as mul_mat_id's (N, K, n_used,
// n_xb, n_expert, T, w_rows, w_row0, y_stride, flags).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : require
#ifndef IDP
#define IDP 1
#endif
#ifndef MUL_MAT_ID
#define MUL_MAT_ID 0
#endif
#if IDP
#extension GL_EXT_spirv_intrinsics : require
#endif

#define W_BINDING 0
#include "dequant.glsl"

#if WTYPE == WT_Q4_0
#define QW 4u    // quant words per block
#define GW 9u    // uvec4 per group of 8 blocks (144 bytes)
#elif WTYPE == WT_Q4_1
#define QW 4u    // (d, m) word, then 4 quant words: 20-byte blocks, always word-aligned
#define GW 10u
#elif WTYPE == WT_Q8_0
#define QW 8u
#define GW 17u   // 272 bytes
#elif WTYPE == WT_Q4_K
#define QW 4u    // (unused: Q4_K reads whole 144-byte super-blocks, see superblock())
#define GW 9u
#elif WTYPE == WT_Q6_K
#define QW 4u    // (unused: Q6_K reads whole 210-byte super-blocks, see superblock6())
#define GW 9u
#else
#error "mul_mat_vecq: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K only"
#endif
#define GQ (4u * GW)  // words per group
#define HB (QBYTES / 2u)  // halfwords per block

layout(constant_id = 0) const uint WG = 128;
layout(constant_id = 1) const uint NR = 4;
layout(constant_id = 2) const uint UNR = 1;
layout(constant_id = 3) const uint MAXM = 1;  // columns of x handled per pass
#ifndef BLK
#define BLK 8
#endif
#ifndef IDP_SAT
#define IDP_SAT 0
#endif
#ifndef RPT
#define RPT 1
#endif
#ifndef PROBE_NOX
#define PROBE_NOX 0
#endif
#ifndef WLOAD5
#define WLOAD5 0  // 1: each BLK-1 block's last word as one 32-bit load (Q4_0 / Q8_0)
#endif
#if WLOAD5 && (BLK != 1 || (WTYPE != WT_Q4_0 && WTYPE != WT_Q8_0))
#error "WLOAD5: Q4_0 / Q8_0 with BLK 1"
#endif
#if PROBE_NOX && RPT == 1
#error "PROBE_NOX: the RPT > 1 shapes only"
#endif
#ifndef SG
#define SG 0
#endif
#ifndef KSUB
#define KSUB 1  // Q4_K: load units per super-block (1: whole super-blocks; 4: quarters)
#endif
#if KSUB != 1 && (KSUB != 4 || WTYPE != WT_Q4_K)
#error "KSUB 4: Q4_K only"
#endif
#if SG
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
#if RPT > 1 && (BLK != 1 || (WTYPE != WT_Q4_0 && WTYPE != WT_Q8_0))
#error "RPT > 1: Q4_0 / Q8_0 with BLK 1 only"
#endif
#define L (WG / NR)  // threads per row
#if BLK != 1 && BLK != 8
#error "BLK: 1 or 8"
#endif
#if (WTYPE == WT_Q4_1 || WTYPE == WT_Q4_K || WTYPE == WT_Q6_K) && BLK != 1
#error "Q4_1, Q4_K, Q6_K: BLK 1 only"
#endif

#if IDP
// OpSDot / OpSDotAccSat with PackedVectorFormat4x8Bit (0): capabilities DotProduct (6019),
// DotProductInput4x8BitPacked (6018)
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot_4x8_packed(uint a, uint b, spirv_literal int fmt);
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4453)
int sdot_4x8_packed_acc_sat(uint a, uint b, int acc, spirv_literal int fmt);
#endif

// acc + the dot product of the four signed bytes of a and b
int dot4(uint a, uint b, int acc) {
#if IDP && IDP_SAT
    return sdot_4x8_packed_acc_sat(a, b, acc, 0);
#elif IDP
    return acc + sdot_4x8_packed(a, b, 0);
#else
    int s = acc;
    [[unroll]] for (int i = 0; i < 4; ++i) {
        s += bitfieldExtract(int(a), 8 * i, 8) * bitfieldExtract(int(b), 8 * i, 8);
    }
    return s;
#endif
}

layout(local_size_x_id = 0) in;

layout(std430, binding = 1) readonly buffer XQ4 { uvec4 xq4[]; };
layout(std430, binding = 1) readonly buffer XQM { uvec2 xqm[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

#if MUL_MAT_ID
#if PROBE_NOX
#error "the routed product has no probe form"
#endif
layout(std430, binding = 3) readonly buffer Ids { int ids[]; };
layout(push_constant) uniform Push {
    uint N; uint K; uint n_used; uint n_xb; uint n_expert; uint T; uint w_rows; uint w_row0;
    uint y_stride; uint flags;
} p;
uint id_w0;   // W row of the pair's expert's row 0 of the computed range (e w_rows + w_row0)
uint id_y0;   // y element of the pair's column 0 of the computed range (pair y_stride + w_row0)
#define VQ_M 1u
#define VQ_W0 id_w0
#define VQ_Y(m, n) (id_y0 + n)
#else
layout(push_constant) uniform Push {
    uint M; uint N; uint K; uint x_stride; uint y_stride; uint x_offset; uint y_offset;
    uint w_row0; uint y_col0; uint flags;
} p;
#define VQ_M p.M
#define VQ_W0 p.w_row0
#define VQ_Y(m, n) (p.y_offset + (m) * p.y_stride + p.y_col0 + n)   // (n unparenthesised: the sum as written before the macro)
#endif

#if SG
// one partial per (row, column) and subgroup: sized for the worst case of 1-wide subgroups
shared float sgred[NR * RPT * MAXM][WG];
#else
shared float red[MAXM][WG];
#endif

uint xbk[MAXM];      // first x block of each column (columns >= M repeat M - 1)
uint mbase;          // first meta uvec2 (4 * M * nb)
float acc[MAXM];

// one weight block (scale dw, Q4_1's min mw, quant words q) at block index g of the row
void block(float dw, float mw, const uint q[QW], uint g) {
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        const uint xb = xbk[m] + g;
        const uvec4 x0 = xq4[2u * xb];
        const uvec4 x1 = xq4[2u * xb + 1u];
        const uvec2 meta = xqm[mbase + xb];
        const uint X[8] = uint[8](x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w);
        int s = 0;
#if WTYPE == WT_Q4_0
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            s = dot4(q[j] & 0x0F0F0F0Fu, X[j], s);              // elements 4j..4j+3
            s = dot4((q[j] >> 4) & 0x0F0F0F0Fu, X[j + 4u], s);  // elements 16+4j..
        }
        s -= 8 * int(meta.y);
#elif WTYPE == WT_Q4_1
        // w_i = dw n_i + mw: sum_i w_i x_i = dw dx sum_i n_i q_i + mw dx sum_i q_i
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            s = dot4(q[j] & 0x0F0F0F0Fu, X[j], s);
            s = dot4((q[j] >> 4) & 0x0F0F0F0Fu, X[j + 4u], s);
        }
        acc[m] = fma(mw * uintBitsToFloat(meta.x), float(int(meta.y)), acc[m]);
#else
        [[unroll]] for (uint j = 0u; j < 8u; ++j) {
            s = dot4(q[j], X[j], s);
        }
#endif
        acc[m] = fma(dw * uintBitsToFloat(meta.x), float(s), acc[m]);
    }
}

// bytes 2..5 of the 8 bytes lo | hi << 32
uint funnel16(uint lo, uint hi) {
    return (lo >> 16) | (hi << 16);
}

#if BLK == 8
// one group of 8 blocks (words from the group's first byte), first block index g0
void group(const uvec4 q4[GW], uint g0) {
    uint w[GQ];
    [[unroll]] for (uint i = 0u; i < GW; ++i) {
        w[4u * i] = q4[i].x;
        w[4u * i + 1u] = q4[i].y;
        w[4u * i + 2u] = q4[i].z;
        w[4u * i + 3u] = q4[i].w;
    }
    [[unroll]] for (uint b = 0u; b < 8u; ++b) {
        const bool odd = (b & 1u) != 0u;
        // block b at byte QBYTES b: word (QBYTES / 2) (b / 2) (even b), or the high half of
        // word (QBYTES / 2) (b / 2) + QW (odd b)
        const uint w0 = (QBYTES / 2u) * (b >> 1) + (odd ? QW : 0u);
        const vec2 dd = unpackHalf2x16(w[w0]);
        uint q[QW];
        [[unroll]] for (uint j = 0u; j < QW; ++j) {
            q[j] = odd ? w[w0 + 1u + j] : funnel16(w[w0 + j], w[w0 + j + 1u]);
        }
        block(odd ? dd.y : dd.x, 0.0, q, g0 + b);
    }
}
#else
// the QW + 1 words of block G of the weight tensor (G: global block index) from the word
// holding its first byte; the last word from two halfwords (never past the block)
void load_block(uint G, out uint w[QW + 1u]) {
#if WTYPE == WT_Q4_1
    [[unroll]] for (uint i = 0u; i <= QW; ++i) {
        w[i] = w_u32[5u * G + i];  // (d, m), then the quants
    }
    return;
#endif
    const uint hb = HB * G;  // halfword index of the block
    const uint wb = hb >> 1;
    [[unroll]] for (uint i = 0u; i < QW; ++i) {
        w[i] = w_u32[wb + i];
    }
#if WLOAD5
    // the word after: whole inside the block for odd hb; for even hb its low half is the
    // block's last two bytes (all decode_block / unpack_block use of it), its high half the next
    // block's or, after the binding's last row, bytes the host checked the binding holds
    w[QW] = w_u32[wb + QW];
    return;
#endif
    const uint lo = uint(w_u16[hb + HB - 2u]);
    const uint hi = uint(w_u16[hb + HB - 1u]);
    w[QW] = (hb & 1u) != 0u ? (lo | (hi << 16)) : hi;
}

void decode_block(const uint w[QW + 1u], uint G, uint g) {
#if WTYPE == WT_Q4_1
    const vec2 dm = unpackHalf2x16(w[0]);
    const uint q1[QW] = uint[QW](w[1], w[2], w[3], w[4]);
    block(dm.x, dm.y, q1, g);
    return;
#endif
    const bool odd = ((HB * G) & 1u) != 0u;  // block starts 2 bytes past a word boundary
    const vec2 dd = unpackHalf2x16(w[0]);
    uint q[QW];
    [[unroll]] for (uint j = 0u; j < QW; ++j) {
        q[j] = odd ? w[j + 1u] : funnel16(w[j], w[j + 1u]);
    }
    block(odd ? dd.y : dd.x, 0.0, q, g);
}
#endif

#if RPT > 1
// RPT rows per thread (rows row0 + r + i NR, i < RPT): each x block's loads (two uvec4 and its
// meta) serve RPT weight blocks instead of one
#if !SG
shared float red2[RPT][MAXM][WG];
#endif
float accr[RPT][MAXM];

// scale and quant words of a BLK-1 block from its QW + 1 loaded words (as decode_block)
void unpack_block(const uint w[QW + 1u], uint G, out float d, out uint q[QW]) {
    const bool odd = ((HB * G) & 1u) != 0u;
    const vec2 dd = unpackHalf2x16(w[0]);
    [[unroll]] for (uint j = 0u; j < QW; ++j) {
        q[j] = odd ? w[j + 1u] : funnel16(w[j], w[j + 1u]);
    }
    d = odd ? dd.y : dd.x;
}

// block index g of RPT rows (scales d[i], quant words q[i]) against x block g of each column
void block_rows(const float d[RPT], const uint q[RPT][QW], uint g) {
#if PROBE_NOX == 2
    // (probe_vecq_noc_*: the weights' loads alone; the xor of the block's quant bytes and of
    // the 4 bytes of its scale as f32, summed per row: exact in f32 below 2^24 / 255 blocks)
    [[unroll]] for (uint i = 0u; i < RPT; ++i) {
        uint v = floatBitsToUint(d[i]);
        [[unroll]] for (uint j = 0u; j < QW; ++j) {
            v ^= q[i][j];
        }
        v ^= v >> 16;
        v ^= v >> 8;
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            accr[i][m] += float(v & 0xFFu);
        }
    }
    return;
#endif
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
#if PROBE_NOX
        // (probe_vecq_nox_*, tools/probes.py: the kernel without its x loads, every x
        // element 1 with scale 1 and block sum 32, so y is the row sums of the weights)
        const uvec4 x0 = uvec4(0x01010101u), x1 = uvec4(0x01010101u);
        const uvec2 meta = uvec2(floatBitsToUint(1.0), 32u);
#else
        const uint xb = xbk[m] + g;
        const uvec4 x0 = xq4[2u * xb];
        const uvec4 x1 = xq4[2u * xb + 1u];
        const uvec2 meta = xqm[mbase + xb];
#endif
        const uint X[8] = uint[8](x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w);
        const float dx = uintBitsToFloat(meta.x);
        [[unroll]] for (uint i = 0u; i < RPT; ++i) {
            int s = 0;
#if WTYPE == WT_Q4_0
            [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                s = dot4(q[i][j] & 0x0F0F0F0Fu, X[j], s);
                s = dot4((q[i][j] >> 4) & 0x0F0F0F0Fu, X[j + 4u], s);
            }
            s -= 8 * int(meta.y);
#else
            [[unroll]] for (uint j = 0u; j < 8u; ++j) {
                s = dot4(q[i][j], X[j], s);
            }
#endif
            accr[i][m] = fma(d[i] * dx, float(s), accr[i][m]);
        }
    }
}
#endif

#if WTYPE == WT_Q4_K
// byte b (0..11) of the packed 6-bit scales and mins
uint scb(const uint sc[3], uint b) {
    return (sc[b >> 2] >> (8u * (b & 3u))) & 0xFFu;
}

// one Q4_K super-block (256 weights, 144 bytes as 9 uvec4: (d, dmin), 12 bytes of 6-bit
// sub-block scales and mins, 128 bytes of nibbles) at super-block index sb of the row; its 8
// sub-blocks of 32 line up with 8 q8_1 blocks of x. Sub-block j: w = d sc_j n - dmin m_j, so
// sum w x = d sc_j dx sum n q - dmin m_j dx sum q (the x block sum). Bytes 32c..32c+31 of the
// nibbles hold sub-block 2c (low nibbles) and 2c + 1 (high nibbles).
void kquarter(const uvec4 hd, const uvec4 qa, const uvec4 qb, uint sb, uint c) {
    // quarter c of super-block sb: header hd (d, dmin; scale bytes 0-3, 4-7, 8-11) and nibble
    // bytes 32c..32c+31 (qa, qb) = sub-blocks 2c (low nibbles) and 2c + 1 (high); ggml's
    // get_scale_min_k4 branch-free (sub-blocks 4-7: the nibbles of bytes 8-11 with the top
    // 2 bits of bytes 0-3 / 4-7 above them), as cm2_dq_body.glsl
    const vec2 dm = unpackHalf2x16(hd.x);
    const uint sc_hi = (hd.w & 0x0F0F0F0Fu) | ((hd.y & 0xC0C0C0C0u) >> 2);
    const uint mn_hi = ((hd.w >> 4) & 0x0F0F0F0Fu) | ((hd.z & 0xC0C0C0C0u) >> 2);
    const uint W[8] = uint[8](qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w);
    [[unroll]] for (uint h = 0u; h < 2u; ++h) {
        const uint j = 2u * c + h;
        const uint sh = 8u * (j & 3u);
        const float dsc = dm.x * float(((j < 4u ? hd.y : sc_hi) >> sh) & 63u);
        const float dmn = dm.y * float(((j < 4u ? hd.z : mn_hi) >> sh) & 63u);
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            const uint xb = xbk[m] + 8u * sb + j;
            const uvec4 x0 = xq4[2u * xb];
            const uvec4 x1 = xq4[2u * xb + 1u];
            const uvec2 meta = xqm[mbase + xb];
            const uint X[8] = uint[8](x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w);
            int s = 0;
            [[unroll]] for (uint k = 0u; k < 8u; ++k) {
                s = dot4((W[k] >> (4u * h)) & 0x0F0F0F0Fu, X[k], s);
            }
            const float dx = uintBitsToFloat(meta.x);
            acc[m] = fma(dsc * dx, float(s), acc[m]);
            acc[m] = fma(-dmn * dx, float(int(meta.y)), acc[m]);
        }
    }
}

void superblock(const uvec4 v[9], uint sb) {
    [[unroll]] for (uint c = 0u; c < 4u; ++c) {
        kquarter(v[0], v[1u + 2u * c], v[2u + 2u * c], sb, c);
    }
}
#endif

#if WTYPE == WT_Q6_K
// the 4-byte word i of a 2-byte aligned block's bytes: from the raw words r (loaded from the
// word holding the block's first byte) as they are, or shifted by 2 bytes for an odd start
uint bw6(const bool odd, const uint lo, const uint hi) {
    return odd ? funnel16(lo, hi) : lo;
}

// one Q6_K super-block (ggml's block_q6_K: ql[128] low nibbles, qh[64] high 2-bit pairs,
// int8 scales[16], f16 d; 210 bytes, 2-byte aligned) at global super-block index G, super-block
// sb of the row. Half h (128 weights) has ql bytes 64h.., qh bytes 32h.., scales 8h..; its run c
// (32 weights, q8_1 block 8 sb + 4h + c) takes for weight l the low (c < 2) or high nibble of ql
// byte 64h + 32(c & 1) + l and bits 2c.. of qh byte 32h + l, scale 8h + 2c for l < 16, + 1 after
// (ggml's dequantize_row_q6_K). The code minus 32 fits a signed byte: four at a time as
// ((q | 0x80) - 0x20) ^ 0x80 per byte (no borrow crosses a byte).
void superblock6(uint G, uint sb) {
    const uint hb = 105u * G;            // halfword index of the block
    const uint wb = hb >> 1;             // word holding its first byte
    const bool odd = (hb & 1u) != 0u;    // the block starts 2 bytes into that word
    const float d = unpackHalf2x16(uint(w_u16[hb + 104u])).x;
    [[unroll]] for (uint h = 0u; h < 2u; ++h) {
        // raw words: ql bytes 64h.. (16 words + 1), qh bytes 128 + 32h.. (8 + 1), scales
        // 192 + 8h.. (2 + 1; the last only for an odd start: it holds d's bytes then, and
        // lies past the block for an even one)
        uint rq[17], rh[9], rs[3];
        [[unroll]] for (uint i = 0u; i < 17u; ++i) {
            rq[i] = w_u32[wb + 16u * h + i];
        }
        [[unroll]] for (uint i = 0u; i < 9u; ++i) {
            rh[i] = w_u32[wb + 32u + 8u * h + i];
        }
        rs[0] = w_u32[wb + 48u + 2u * h];
        rs[1] = w_u32[wb + 49u + 2u * h];
        rs[2] = (odd || h == 0u) ? w_u32[wb + 50u + 2u * h] : 0u;
        uint QL[16], QH[8];
        [[unroll]] for (uint i = 0u; i < 16u; ++i) {
            QL[i] = bw6(odd, rq[i], rq[i + 1u]);
        }
        [[unroll]] for (uint i = 0u; i < 8u; ++i) {
            QH[i] = bw6(odd, rh[i], rh[i + 1u]);
        }
        const uint S[2] = uint[2](bw6(odd, rs[0], rs[1]), bw6(odd, rs[1], rs[2]));
        [[unroll]] for (uint c = 0u; c < 4u; ++c) {
            const int sa = bitfieldExtract(int(S[c >> 1]), int(16u * (c & 1u)), 8);       // scale 8h + 2c
            const int sbb = bitfieldExtract(int(S[c >> 1]), int(16u * (c & 1u) + 8u), 8); // 8h + 2c + 1
            uint R[8];
            [[unroll]] for (uint k = 0u; k < 8u; ++k) {
                const uint q = ((QL[8u * (c & 1u) + k] >> (4u * (c >> 1))) & 0x0F0F0F0Fu)
                             | (((QH[k] >> (2u * c)) & 0x03030303u) << 4);
                R[k] = ((q | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
            }
            [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
                const uint xb = xbk[m] + 8u * sb + 4u * h + c;
                const uvec4 x0 = xq4[2u * xb];
                const uvec4 x1 = xq4[2u * xb + 1u];
                const uvec2 meta = xqm[mbase + xb];
                const uint X[8] = uint[8](x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w);
                int s0 = 0, s1 = 0;
                [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                    s0 = dot4(R[k], X[k], s0);
                    s1 = dot4(R[k + 4u], X[k + 4u], s1);
                }
                // |sa s0 + sbb s1| <= 2 * 128 * 16 * 32 * 127 < 2^24: exact in f32
                acc[m] = fma(d * uintBitsToFloat(meta.x), float(sa * s0 + sbb * s1), acc[m]);
            }
        }
    }
}
#endif

void main() {
#if MUL_MAT_ID
    const uint wg = gl_WorkGroupID.x;
    const uint pair = gl_WorkGroupID.y;
    const int e = ids[pair];
    id_y0 = pair * p.y_stride + p.w_row0;
#else
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
#endif
#if RPT > 1
    const uint row0 = wg * NR * RPT;
#else
    const uint row0 = wg * NR;
#endif
    if (row0 >= p.N) {
        return;  // whole workgroup: the padding of the folded grid
    }
#if MUL_MAT_ID
    if (e < 0 || uint(e) >= p.n_expert) {  // (the whole workgroup: one pair)
        for (uint n = row0 + gl_LocalInvocationID.x; n < min(row0 + NR * RPT, p.N); n += WG) {
            y[id_y0 + n] = uintBitsToFloat(0x7fc00000u);
        }
        return;
    }
    id_w0 = uint(e) * p.w_rows + p.w_row0;
#endif
    const uint tid = gl_LocalInvocationID.x;
    const uint r = tid % NR;     // this thread's row (of the workgroup's NR)
    const uint lane = tid / NR;  // lane in the row's team of L
    const uint nb = p.K / 32u;   // blocks per row
    const uint row = VQ_W0 + min(row0 + r, p.N - 1u);  // rows past N: computed, not written
#if MUL_MAT_ID
    mbase = 4u * p.T * p.n_xb * nb;
    xbk[0] = ((pair / p.n_used) * p.n_xb + (p.n_xb > 1u ? pair % p.n_used : 0u)) * nb;
    acc[0] = 0.0;
#else
    mbase = 4u * p.M * nb;

    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        xbk[m] = min(m, p.M - 1u) * nb;
        acc[m] = 0.0;
    }
#endif

#if RPT > 1
    uint G0[RPT];  // global index of the first block of each of this thread's rows
    [[unroll]] for (uint i = 0u; i < RPT; ++i) {
        G0[i] = (VQ_W0 + min(row0 + r + i * NR, p.N - 1u)) * nb;
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            accr[i][m] = 0.0;
        }
    }
    for (uint g0 = lane; g0 < nb; g0 += UNR * L) {
        uint w[UNR][RPT][QW + 1u];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            [[unroll]] for (uint i = 0u; i < RPT; ++i) {
                load_block(G0[i] + min(g0 + u * L, nb - 1u), w[u][i]);
            }
        }
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < nb) {
                float d[RPT];
                uint q[RPT][QW];
                [[unroll]] for (uint i = 0u; i < RPT; ++i) {
                    unpack_block(w[u][i], G0[i] + g, d[i], q[i]);
                }
                block_rows(d, q, g);
            }
        }
    }
#elif BLK == 8
    const uint ng = nb / 8u;          // groups per row
    const uint gb = row * (ng * GW);  // first uvec4 of the row
    for (uint g0 = lane; g0 < ng; g0 += UNR * L) {
        uvec4 q[UNR][GW];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = min(g0 + u * L, ng - 1u);  // past the row: a valid address, unused
            [[unroll]] for (uint i = 0u; i < GW; ++i) {
                q[u][i] = w_u128[gb + g * GW + i];
            }
        }
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < ng) {
                group(q[u], 8u * g);
            }
        }
    }
#elif WTYPE == WT_Q4_K && KSUB == 4
    // quarter super-blocks as load units: unit g = 4 sb + c reads sb's header and nibble bytes
    // 32c..32c+31 (3 uvec4; the 4 lanes of one super-block read the same header)
    const uint nsb = nb / 8u;
    const uint nu = 4u * nsb;
    const uint sbase = row * (nsb * 9u);
    for (uint g0 = lane; g0 < nu; g0 += UNR * L) {
        uvec4 v[UNR][3];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = min(g0 + u * L, nu - 1u);
            const uint b = sbase + (g >> 2) * 9u;
            v[u][0] = w_u128[b];
            v[u][1] = w_u128[b + 1u + 2u * (g & 3u)];
            v[u][2] = w_u128[b + 2u + 2u * (g & 3u)];
        }
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < nu) {
                kquarter(v[u][0], v[u][1], v[u][2], g >> 2, g & 3u);
            }
        }
    }
#elif WTYPE == WT_Q4_K
    const uint nsb = nb / 8u;          // super-blocks per row (K % 256 == 0)
    const uint sbase = row * (nsb * 9u);  // first uvec4 of the row
    for (uint g0 = lane; g0 < nsb; g0 += UNR * L) {
        uvec4 v[UNR][9];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = min(g0 + u * L, nsb - 1u);
            [[unroll]] for (uint i = 0u; i < 9u; ++i) {
                v[u][i] = w_u128[sbase + g * 9u + i];
            }
        }
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < nsb) {
                superblock(v[u], g);
            }
        }
    }
#elif WTYPE == WT_Q6_K
    const uint nsb = nb / 8u;   // super-blocks per row (K % 256 == 0)
    const uint S0 = row * nsb;  // global index of the row's first super-block
    for (uint g0 = lane; g0 < nsb; g0 += UNR * L) {
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < nsb) {
                superblock6(S0 + g, g);
            }
        }
    }
#else
    const uint G0 = row * nb;  // global index of the row's first block
    for (uint g0 = lane; g0 < nb; g0 += UNR * L) {
        uint w[UNR][QW + 1u];
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            load_block(G0 + min(g0 + u * L, nb - 1u), w[u]);
        }
        [[unroll]] for (uint u = 0u; u < UNR; ++u) {
            const uint g = g0 + u * L;
            if (u == 0u || g < nb) {
                decode_block(w[u], G0 + g, g);
            }
        }
    }
#endif

#if SG
    // value v = (m RPT + i) NR + rr: column m, row row0 + rr + i NR
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        [[unroll]] for (uint i = 0u; i < RPT; ++i) {
#if RPT > 1
            const float a = accr[i][m];
#else
            const float a = acc[m];
#endif
            [[unroll]] for (uint rr = 0u; rr < NR; ++rr) {
                const float s = subgroupAdd(r == rr ? a : 0.0);
                if (subgroupElect()) {
                    sgred[(m * RPT + i) * NR + rr][gl_SubgroupID] = s;
                }
            }
        }
    }
    barrier();
    if (tid < NR * RPT * MAXM) {
        const uint rr = tid % NR;
        const uint i = (tid / NR) % RPT;
        const uint m = tid / (NR * RPT);
        const uint n = row0 + rr + i * NR;
        if (m < VQ_M && n < p.N) {
            float s = 0.0;
            for (uint k = 0u; k < gl_NumSubgroups; ++k) {
                s += sgred[tid][k];
            }
            y[VQ_Y(m, n)] = s;
        }
    }
#else  // SG 0
#if RPT > 1
    [[unroll]] for (uint i = 0u; i < RPT; ++i) {
        [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
            red2[i][m][tid] = accr[i][m];
        }
    }
    barrier();
    if (tid < NR * RPT * MAXM) {
        const uint rr = tid % NR;
        const uint i = (tid / NR) % RPT;
        const uint m = tid / (NR * RPT);
        const uint n = row0 + rr + i * NR;
        if (m < VQ_M && n < p.N) {
            float s = 0.0;
            [[unroll]] for (uint k = 0u; k < L; ++k) {
                s += red2[i][m][k * NR + rr];
            }
            y[VQ_Y(m, n)] = s;
        }
    }
    return;
#endif
    [[unroll]] for (uint m = 0u; m < MAXM; ++m) {
        red[m][tid] = acc[m];
    }
    barrier();
    if (tid < NR * MAXM) {
        const uint rr = tid % NR;
        const uint m = tid / NR;
        if (m < VQ_M && row0 + rr < p.N) {
            float s = 0.0;
            [[unroll]] for (uint i = 0u; i < L; ++i) {
                s += red[m][i * NR + rr];
            }
            y[VQ_Y(m, row0 + rr)] = s;
        }
    }
#endif  // SG
}
