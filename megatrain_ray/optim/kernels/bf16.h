// The bfloat16 conversions, the rounding noise's hash and the gradient loads that the AdamW kernels share
// (kernels/adamw.cpp for the full state, kernels/lean_adamw.cpp for the lean one), each bit for bit as the torch
// code it mirrors (optim/adamw.py). Included inside each kernel's anonymous namespace.
#pragma once

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// Stochastic rounding to bf16: add 16 bits of noise below the kept bits, truncate. Infinities get no noise
// (it would turn them into NaNs) and NaNs stay quiet NaNs. Branch-free, so that the loop vectorizes.
inline uint16_t float_to_bf16_stochastic(float f, uint32_t noise16) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const bool special = (bits & 0x7f800000u) == 0x7f800000u;
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + (special ? 0u : noise16)) >> 16;
    return static_cast<uint16_t>(nan ? rounded | 0x40u : rounded);
}

// The low-bias 32-bit integer hash [16 21f0aaad 15 735a2d97 15] of Wellons' hash-prospector.
inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21f0aaadu;
    x ^= x >> 15;
    x *= 0x735a2d97u;
    x ^= x >> 15;
    return x;
}

template <typename G>
inline float load(const G* g, int64_t i);
template <>
inline float load<float>(const float* g, int64_t i) { return g[i]; }
template <>
inline float load<uint16_t>(const uint16_t* g, int64_t i) { return bf16_to_float(g[i]); }
