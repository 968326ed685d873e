// q8_1.glsl: the block quantization of quantize_q8_1.comp (see there for the math and the
// scratch layout), shared with the kernels that write q8_1 x as they produce x (rms_norm.comp
// with Q8 = 1). Before including: Q8_WG (the workgroup size, a multiple of 8) and the
// scratch buffers `uint xq[]` / `uvec2 xqm[]` (one binding, two views).
// q8_1_store() has barriers: every invocation of the workgroup calls it, in uniform control
// flow; invocation tid holds elements 4 (tid % 8) .. + 3 of block j as raw f32 bits u[].

shared uint s_amax[Q8_WG];
shared int s_sum[Q8_WG];

// round(|x| / d) half away from zero for the bits a = |x| (< inf) and a normal d (exponent
// field ed, mantissa md with the implicit bit): floor(2 |x| / d) by integer division, then
// (n + 1) / 2 = floor(|x| / d + 1/2)
uint quant_mag(uint a, uint ed, uint md) {
    if (a == 0u) {
        return 0u;
    }
    uint ex = a >> 23;
    uint mx = a & 0x7FFFFFu;
    if (ex == 0u) {
        ex = 1u;  // subnormal: no implicit bit, exponent of the smallest normal
    } else {
        mx |= 0x800000u;
    }
    // 2 |x| / d = mx / md * 2^s
    const int s = min(int(ex) - int(ed) + 1, 8);  // <= 8 for |x| <= amax (mx << 8 < 2^32)
    uint n;
    if (s >= 0) {
        n = (mx << uint(s)) / md;
    } else if (s > -25) {
        n = (mx >> uint(-s)) / md;  // floor(floor(mx / 2^-s) / md) = floor(mx / (2^-s md))
    } else {
        n = 0u;
    }
    return min((n + 1u) >> 1, 127u);
}

void q8_1_store(uint tid, uint j, uint nblk, bool live, uint u[4]) {
    const uint sub = tid & 7u;
    uint am = 0u;
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
        am = max(am, u[i] & 0x7FFFFFFFu);
    }
    s_amax[tid] = am;
    barrier();
    uint amax = 0u;
    [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        amax = max(amax, s_amax[(tid & ~7u) + i]);
    }
    precise float d = uintBitsToFloat(amax) * uintBitsToFloat(0x3C010204u);
    uint db = floatBitsToUint(d);
    if (db < 0x00800000u || db >= 0x7F800000u) {
        db = 0u;  // not a normal float: an all-zero (or tiny) block
    }
    const uint ed = db >> 23;
    const uint md = (db & 0x7FFFFFu) | 0x800000u;

    uint word = 0u;
    int sum = 0;
    [[unroll]] for (uint i = 0u; i < 4u; ++i) {
        const int qa = db == 0u ? 0 : int(quant_mag(u[i] & 0x7FFFFFFFu, ed, md));
        const int q = (u[i] & 0x80000000u) != 0u ? -qa : qa;
        sum += q;
        word |= (uint(q) & 0xFFu) << (8u * i);
    }
    s_sum[tid] = sum;
    barrier();
    if (live) {
        xq[8u * j + sub] = word;
        if (sub == 0u) {
            int total = 0;
            [[unroll]] for (uint i = 0u; i < 8u; ++i) {
                total += s_sum[tid + i];
            }
            xqm[4u * nblk + j] = uvec2(db, uint(total));
        }
    }
}
