#version 450
// mul_mat_cm2_<type>_f32_<tile>: y[m, c0 + n] = sum_k x[m, k] * W[r0 + n, k] with
// GL_NV_cooperative_matrix2: workgroup-scope cooperative matrices, the driver staging the
// operands through shared memory itself (its own pipelining, shared layout and fragment
// loads: what mul_mat_coopmat.comp does by hand at subgroup scope), tensor-addressed loads
// with bounds clamping, and the weights decoded from their ggml blocks by a decode function
// the driver calls per element it stages (cm2_decode.glsl).
//
// Operands: A = a BW x BK tile of W (rows r0 + n0.., decoded to f16), B = a BK x BX tile of
// x^T, read from xh: x already converted to f16, compact rows of K (convert_rows_f32_f16 runs
// before; converting once per product, not once per tile). The BW x BX f32 accumulator is
// stored transposed into y (rows of x, columns of W), elements outside M x N dropped.
//
// Tile (specialization constants, as ggml-vulkan's mul_mm_cm2: one SPIR-V module per weight
// type serves every tiling; they size the workgroup-scope matrices, whose dimensions
// GL_NV_cooperative_matrix2 takes from constants the driver knows when it makes the pipeline):
// BW rows of W x BX rows of x per workgroup, BK the K slice per step, NT invocations
// (constant_id 0, also the workgroup size). Interior tiles load unclamped (with alignment the compiler can prove where K
// and the K range allow: the fast path below); tiles crossing N or M, and the last K step
// when BK does not divide K, load with gl_CooperativeMatrixClampModeConstantNV (zeros outside).
//
// Push constants: as mul_mat_coopmat (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0,
// y_col0, flags, ksplit); x_stride / x_offset / flags are the f32 x's and unused here (xh is
// compact). Workgroups: (ceil(N / BW), ceil(M / BX), splits). Split K (ksplit > 0, a multiple
// of BK): workgroup z sums k in [z ksplit, (z + 1) ksplit) and stores its partial at
// y_offset + z M y_stride, as mul_mat_coopmat (reduce_splitk.comp adds them).
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_GOOGLE_include_directive : require

layout(constant_id = 0) const uint NT = 256;
layout(constant_id = 1) const uint BW = 128;
layout(constant_id = 2) const uint BX = 128;
layout(constant_id = 3) const uint BK = 64;

layout(local_size_x_id = 0) in;

#include "cm2_decode.glsl"

layout(std430, binding = 1) readonly buffer XH { float16_t xh[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0, y_col0, flags, ksplit;
} p;

#define CLAMP gl_CooperativeMatrixClampModeConstantNV

void main() {
    const uint n0 = gl_WorkGroupID.x * BW;
    const uint m0 = gl_WorkGroupID.y * BX;
    uint k0 = 0u, k1 = p.K, yoff = p.y_offset + p.y_col0;
    if (p.ksplit != 0u) {
        k0 = gl_WorkGroupID.z * p.ksplit;
        k1 = min(p.K, k0 + p.ksplit);
        yoff = p.y_offset + gl_WorkGroupID.z * p.M * p.y_stride + p.y_col0;
    }
    const uint wrows = p.w_row0 + p.N;

    tensorLayoutNV<2> lw = createTensorLayoutNV(2);
    tensorLayoutNV<2, CLAMP> lwc = createTensorLayoutNV(2, CLAMP);
    tensorLayoutNV<2> lx = createTensorLayoutNV(2);
    tensorLayoutNV<2, CLAMP> lxc = createTensorLayoutNV(2, CLAMP);
#if QK > 1
    lw = setTensorLayoutBlockSizeNV(lw, 1, QK);
    lwc = setTensorLayoutBlockSizeNV(lwc, 1, QK);
#endif
    lw = setTensorLayoutDimensionNV(lw, wrows, p.K);
    lwc = setTensorLayoutDimensionNV(lwc, wrows, p.K);
    lx = setTensorLayoutDimensionNV(lx, p.M, p.K);
    lxc = setTensorLayoutDimensionNV(lxc, p.M, p.K);
    tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);

    coopmat<float, gl_ScopeWorkgroup, BW, BX, gl_MatrixUseAccumulator> acc =
        coopmat<float, gl_ScopeWorkgroup, BW, BX, gl_MatrixUseAccumulator>(0.0);
    coopmat<float16_t, gl_ScopeWorkgroup, BW, BK, gl_MatrixUseA> a;
    coopmat<float16_t, gl_ScopeWorkgroup, BK, BX, gl_MatrixUseB> b;

    // whole BK steps; the step crossing K (if any) is loaded clamped below
    const uint kfull = k0 + (k1 - k0) / BK * BK;
    const bool interior = n0 + BW <= p.N && m0 + BX <= p.M;
    uint k = k0;
    if (interior && (k0 % 256u) == 0u && ((k1 - k0) % 256u) == 0u && (p.K % 8u) == 0u) {
        // The fast path: every load in bounds and 16-byte aligned. The masks below change no
        // value here but let the compiler prove the alignment (rows of K % 8 == 0 halves,
        // slices starting at multiples of 256), so the driver's staging uses vector loads
        // instead of element loads (what ggml-vulkan's mul_mm_cm2 does); 256 / BK steps unrolled.
        const uint stride = p.K & ~7u;
        uint kk = k0 & ~255u;
        lx = setTensorLayoutStrideNV(lx, stride, 1);
#if QK == 1
        lw = setTensorLayoutStrideNV(lw, stride, 1);
#endif
        const uint iters = (k1 - k0) / 256u;
        [[dont_unroll]] for (uint i = 0u; i < iters; ++i) {
            [[unroll]] for (uint j = 0u; j < 256u / BK; ++j) {
                coopMatLoadTensorNV(a, w_blocks, 0, sliceTensorLayoutNV(lw, p.w_row0 + n0, BW, kk, BK) CM2_DECODE);
                coopMatLoadTensorNV(b, xh, 0, sliceTensorLayoutNV(lx, m0, BX, kk, BK), tr);
                acc = coopMatMulAdd(a, b, acc);
                kk += BK;
            }
        }
        k = k1;
    } else if (interior) {
        for (; k < kfull; k += BK) {
            coopMatLoadTensorNV(a, w_blocks, 0, sliceTensorLayoutNV(lw, p.w_row0 + n0, BW, k, BK) CM2_DECODE);
            coopMatLoadTensorNV(b, xh, 0, sliceTensorLayoutNV(lx, m0, BX, k, BK), tr);
            acc = coopMatMulAdd(a, b, acc);
        }
    } else {
        for (; k < kfull; k += BK) {
            coopMatLoadTensorNV(a, w_blocks, 0, sliceTensorLayoutNV(lwc, p.w_row0 + n0, BW, k, BK) CM2_DECODE);
            coopMatLoadTensorNV(b, xh, 0, sliceTensorLayoutNV(lxc, m0, BX, k, BK), tr);
            acc = coopMatMulAdd(a, b, acc);
        }
    }
    if (k < k1) {  // K % BK != 0: the last step reads zeros past K
        coopMatLoadTensorNV(a, w_blocks, 0, sliceTensorLayoutNV(lwc, p.w_row0 + n0, BW, k, BK) CM2_DECODE);
        coopMatLoadTensorNV(b, xh, 0, sliceTensorLayoutNV(lxc, m0, BX, k, BK), tr);
        acc = coopMatMulAdd(a, b, acc);
    }

    tensorLayoutNV<2, CLAMP> ly = createTensorLayoutNV(2, CLAMP);
    ly = setTensorLayoutDimensionNV(ly, p.M, p.N);
    ly = setTensorLayoutStrideNV(ly, p.y_stride, 1);
    coopMatStoreTensorNV(acc, y, yoff, sliceTensorLayoutNV(ly, m0, BX, n0, BW), tr);
}
