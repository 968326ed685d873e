// Shared helpers for every vkxsplit kernel. Integer bit math only, so results are exact and
// independent of the device's float rounding and denormal modes.
#ifndef VKX_COMMON_GLSL
#define VKX_COMMON_GLSL

// f32 bits -> bf16 bits, round to nearest even; NaN stays NaN (quiet), inf stays inf.
uint f32_to_bf16_bits(uint u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u >> 16) | 0x40u;  // quiet NaN, sign and top payload kept
    }
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

uint bf16_bits_to_f32(uint h) { return h << 16; }

// f32 bits -> f16 bits, round to nearest even, with subnormals, overflow to inf and NaN.
uint f32_to_f16_bits(uint u) {
    uint sign = (u >> 16) & 0x8000u;
    uint a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {                  // NaN: keep top payload bits, force quiet
        return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
    }
    if (a >= 0x477ff000u) {                 // rounds to >= 65520: inf
        return sign | 0x7c00u;
    }
    if (a >= 0x38800000u) {                 // normal f16 range (>= 2^-14)
        uint r = a - 0x38000000u;           // rebias exponent 127 -> 15
        r = r + 0xfffu + ((r >> 13) & 1u);
        return sign | (r >> 13);
    }
    if (a < 0x33000001u) {                  // below half the smallest subnormal (2^-25): zero
        return sign;
    }
    // subnormal f16: value = m * 2^(e-150); f16 subnormal unit is 2^-24
    uint e = a >> 23;
    uint m = (a & 0x7fffffu) | 0x800000u;
    uint shift = 126u - e;                   // 14 + (127 - e) - 1 ... bits to drop below 2^-24
    // we need m * 2^(e-150) / 2^-24 = m >> (126 - e)
    uint q = m >> shift;
    uint rem = m & ((1u << shift) - 1u);
    uint half_ = 1u << (shift - 1u);
    if (rem > half_ || (rem == half_ && (q & 1u) == 1u)) {
        q += 1u;
    }
    return sign | q;
}

// f16 bits -> f32 bits (exact: every f16 is an f32).
uint f16_bits_to_f32(uint h) {
    uint sign = (h & 0x8000u) << 16;
    uint e = (h >> 10) & 0x1fu;
    uint m = h & 0x3ffu;
    if (e == 0x1fu) {
        return sign | 0x7f800000u | (m << 13);
    }
    if (e == 0u) {
        if (m == 0u) {
            return sign;
        }
        // normalise the subnormal
        uint s = 0u;
        while ((m & 0x400u) == 0u) {
            m <<= 1;
            s += 1u;
        }
        m &= 0x3ffu;
        return sign | ((113u - s) << 23) | (m << 13);
    }
    return sign | ((e + 112u) << 23) | (m << 13);
}

// theta - 2 pi k, k = round(theta / 2 pi): Cody-Waite with 2 pi split into parts of 11
// significant bits (k * C1, k * C2 exact for |theta| < 5e4), so that sin/cos are only ever
// asked about [-pi, pi], where every driver is accurate. (RoPE angles: rope.comp, kv_store.comp.)
float reduce_2pi(float t) {
    const float C1 = 6.28125;
    const float C2 = 0.0019350051879882812;
    const float C3 = 3.019916050561733e-07;
    float k = roundEven(t * 0.15915493667125702);
    return ((t - k * C1) - k * C2) - k * C3;
}

#endif
