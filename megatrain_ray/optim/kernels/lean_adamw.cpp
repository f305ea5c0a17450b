// One-pass AdamW over the lean optimizer state (optimizer.state=lean), for the CPU optimizer workers.
//
// Per element: read the gradient (fp32 or bf16), the bf16 master and its bf16 compensation, both moments (8-bit
// codes with a float32 scale per block, or bf16); write master, compensation and moments. The master is the
// streaming copy, so nothing else is written: 14 bytes per parameter with int8 moments and bf16 gradients, 18 with
// bf16 moments. The math is megatrain_ray/optim/lean_adamw.py's (see its docstring), repeated bit for bit: the same
// float32 operations in the same order, compiled with -ffp-contract=off (kernels/__init__.py) so that no
// multiply-add is fused, sqrt and division IEEE-rounded. Built by kernels/__init__.py, called through ctypes.
//
// int8 moments: a block of `block` elements (256 or 2048; the span starts on a block) is read and updated into
// float32 scratch, its new absmax taken, then each moment is stored as the byte of its nearest map value
// (optim/quant8.py: count of midpoints below x * (1 / absmax), minus the index of 0.0, mod 256). Blocks are
// independent, so threads split on them and the result does not depend on the thread count.
#include <cmath>
#include <cstdint>
#include <cstring>
// With AVX-512 the int8 blocks run on explicit 16-lane code (q8_block_avx512): GCC vectorizes the portable loops
// too, but gathers the tables with 64-bit indices, 8 lanes at a time: 3.6 ns per element on one Sapphire Rapids
// core against 2.1 for the explicit code (4.3 before the one-load encoding). Both are the same float32 operations in the same order, so the bytes
// written are the same (tests/unit/test_lean_adamw.py holds either to the torch definition).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define MEGATRAIN_LEAN_AVX512 1
#else
#define MEGATRAIN_LEAN_AVX512 0
#endif

namespace {

#include "bf16.h"

struct Constants {
    float omb1, b2, omb2, eps, bc2_sqrt, step, decay, coef;
};

// One moment map (optim/quant8.ByteCode): the value of each stored byte, and per 16-bit prefix of a float (its top
// bits: sign, exponent, 7 bits of mantissa) the entry quant8.prefix_table packs: the number of midpoints below every
// float of the prefix in the high 16 bits, and in the low 16 where the one midpoint inside the prefix, if any, lies
// (no prefix holds two: quant8 checks). The stored byte of scaled value x is that count, plus one where x's low 16
// bits are past the midpoint's, minus the index of 0.0, mod 256: one table load and one integer compare per value.
// A binary search's branches mispredict on every other step (measured: 0.32 G params/s on 16 cores against 4.4 for
// the full state); a count-then-compare with a second load (the midpoint) and 64-bit indices ran at 1.7.
struct Code {
    const float* values;
    const uint32_t* prefix;  // 256 KB, of which a run touches the few lines of its values' exponents
    uint32_t zero;
    inline float decode(uint8_t byte) const { return values[byte]; }
    inline uint8_t encode(float x) const {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        const uint32_t entry = prefix[bits >> 16];
        // Past the midpoint: a larger magnitude for a positive x, a smaller one for a negative x (flipped low bits).
        const uint32_t low = (bits ^ (0u - (bits >> 31))) & 0xffffu;
        const uint32_t count = (entry >> 16) + static_cast<uint32_t>(low > (entry & 0xffffu));
        return static_cast<uint8_t>(count - zero);
    }
};

// The update of one element from its float32 moments; writes master and compensation.
inline void update_weight(uint16_t* p, uint16_t* c, int32_t i, float m, float v, bool decayed, const Constants& k) {
    const float denom = std::sqrt(v) / k.bc2_sqrt + k.eps;
    const float ratio = m / denom;
    const float w = bf16_to_float(p[i]);
    const float decay = decayed ? k.decay : 0.0f;
    const float u = -(w * decay) - ratio * k.step;
    const float y = bf16_to_float(c[i]) + u;
    const uint16_t t = float_to_bf16(w + y);
    c[i] = float_to_bf16(y - (bf16_to_float(t) - w));
    p[i] = t;
}

// Elements [0, n) of one quantization block: p, c, q1, q2 and g at the block's first element, s1 and s2 at its
// scales, `decay_n` of its elements (from the first) with weight decay. The block is read once: the moments are
// decoded and updated into float32 scratch (in L1) with their new absmax, then the weights updated and the moments
// encoded from there. The weight update has a loop of its own here: fused into the first, GCC's AVX2 code for the
// block ran at 0.65 of this rate (11 against 7 ns per element on a Sapphire Rapids core built for x86-64-v3).
template <typename G>
void q8_block(uint16_t* p, uint16_t* c, uint8_t* q1, uint8_t* q2, float* s1, float* s2, const G* g, int32_t n,
              int32_t decay_n, const Constants& k, const Code& code1, const Code& code2) {
    alignas(64) float m_new[2048], v_new[2048];
    const float scale1 = *s1, scale2 = *s2;
    // The absmax as the largest bit pattern of |m|: for non-negative floats integer order is float order, an
    // integer max reduction vectorizes (a float one needs -ffinite-math-only), and a NaN wins, as in torch's amax.
    uint32_t top1 = 0, top2 = 0;
#pragma omp simd reduction(max : top1, top2)
    for (int32_t i = 0; i < n; ++i) {
        const float grad = load(g, i) * k.coef;
        const float m_old = code1.decode(q1[i]) * scale1, v_old = code2.decode(q2[i]) * scale2;
        const float m = m_old + (grad - m_old) * k.omb1;
        const float v = v_old * k.b2 + (grad * k.omb2) * grad;
        m_new[i] = m, v_new[i] = v;
        uint32_t b1, b2;
        std::memcpy(&b1, &m, sizeof b1);
        std::memcpy(&b2, &v, sizeof b2);
        b1 &= 0x7fffffffu, b2 &= 0x7fffffffu;
        top1 = b1 > top1 ? b1 : top1;
        top2 = b2 > top2 ? b2 : top2;
    }
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) update_weight(p, c, i, m_new[i], v_new[i], i < decay_n, k);
    float max1, max2;
    std::memcpy(&max1, &top1, sizeof max1);
    std::memcpy(&max2, &top2, sizeof max2);
    const float inv1 = max1 > 0.0f ? 1.0f / max1 : 0.0f, inv2 = max2 > 0.0f ? 1.0f / max2 : 0.0f;
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) {
        q1[i] = code1.encode(m_new[i] * inv1);
        q2[i] = code2.encode(v_new[i] * inv2);
    }
    *s1 = max1, *s2 = max2;
}

#if MEGATRAIN_LEAN_AVX512
// 16 lanes of kernels/bf16.h's conversions and loads, bit for bit.
inline __m512 bf16x16_to_float(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i float_to_bf16x16(__m512 f) {  // round to nearest even, NaN kept quiet
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

inline __m512 load16(const float* g, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, g); }
inline __m512 load16(const uint16_t* g, __mmask16 lanes) {
    return bf16x16_to_float(_mm256_maskz_loadu_epi16(lanes, g));
}

inline __m512 neg16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// Code::encode on 16 lanes.
inline __m128i encode16(const Code& code, __m512 x, __mmask16 lanes) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i entry = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, _mm512_srli_epi32(bits, 16),
                                                      code.prefix, 4);
    const __m512i low = _mm512_and_si512(_mm512_xor_si512(bits, _mm512_srai_epi32(bits, 31)), _mm512_set1_epi32(0xffff));
    const __mmask16 past = _mm512_cmpgt_epu32_mask(low, _mm512_and_si512(entry, _mm512_set1_epi32(0xffff)));
    __m512i count = _mm512_srli_epi32(entry, 16);
    count = _mm512_mask_add_epi32(count, past, count, _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi8(_mm512_sub_epi32(count, _mm512_set1_epi32(static_cast<int>(code.zero))));
}

// q8_block in 16-lane steps, the last one masked, the weight update fused into the first pass.
template <typename G>
void q8_block_avx512(uint16_t* p, uint16_t* c, uint8_t* q1, uint8_t* q2, float* s1, float* s2, const G* g,
                     int32_t n, int32_t decay_n, const Constants& k, const Code& code1, const Code& code2) {
    alignas(64) float m_new[2048], v_new[2048];
    const __m512 scale1 = _mm512_set1_ps(*s1), scale2 = _mm512_set1_ps(*s2);
    const __m512 coef = _mm512_set1_ps(k.coef), omb1 = _mm512_set1_ps(k.omb1), b2 = _mm512_set1_ps(k.b2);
    const __m512 omb2 = _mm512_set1_ps(k.omb2), bc2 = _mm512_set1_ps(k.bc2_sqrt), eps = _mm512_set1_ps(k.eps);
    const __m512 step = _mm512_set1_ps(k.step), decay = _mm512_set1_ps(k.decay);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i top1 = _mm512_setzero_si512(), top2 = _mm512_setzero_si512();
    for (int32_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
        const __m512 grad = _mm512_mul_ps(load16(g + i, lanes), coef);
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, q1 + i));
        const __m512i b2i = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, q2 + i));
        const __m512 m_old = _mm512_mul_ps(_mm512_i32gather_ps(b1, code1.values, 4), scale1);
        const __m512 v_old = _mm512_mul_ps(_mm512_i32gather_ps(b2i, code2.values, 4), scale2);
        const __m512 m = _mm512_add_ps(m_old, _mm512_mul_ps(_mm512_sub_ps(grad, m_old), omb1));
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(v_old, b2), _mm512_mul_ps(_mm512_mul_ps(grad, omb2), grad));
        _mm512_store_ps(m_new + i, m);
        _mm512_store_ps(v_new + i, v);
        // update_weight
        const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
        const __m512 ratio = _mm512_div_ps(m, denom);
        const __m512 w = bf16x16_to_float(_mm256_maskz_loadu_epi16(lanes, p + i));
        const __mmask16 decayed = _mm512_cmplt_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(i), lane),
                                                          _mm512_set1_epi32(decay_n));
        const __m512 d = _mm512_maskz_mov_ps(decayed, decay);
        const __m512 u = _mm512_sub_ps(neg16(_mm512_mul_ps(w, d)), _mm512_mul_ps(ratio, step));
        const __m512 y = _mm512_add_ps(bf16x16_to_float(_mm256_maskz_loadu_epi16(lanes, c + i)), u);
        const __m256i t = float_to_bf16x16(_mm512_add_ps(w, y));
        const __m256i comp = float_to_bf16x16(_mm512_sub_ps(y, _mm512_sub_ps(bf16x16_to_float(t), w)));
        _mm256_mask_storeu_epi16(c + i, lanes, comp);
        _mm256_mask_storeu_epi16(p + i, lanes, t);
        top1 = _mm512_mask_max_epu32(top1, lanes, top1, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
        top2 = _mm512_mask_max_epu32(top2, lanes, top2, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
    }
    const uint32_t t1 = _mm512_reduce_max_epu32(top1), t2 = _mm512_reduce_max_epu32(top2);
    float max1, max2;
    std::memcpy(&max1, &t1, sizeof max1);
    std::memcpy(&max2, &t2, sizeof max2);
    const float inv1 = max1 > 0.0f ? 1.0f / max1 : 0.0f, inv2 = max2 > 0.0f ? 1.0f / max2 : 0.0f;
    const __m512 vinv1 = _mm512_set1_ps(inv1), vinv2 = _mm512_set1_ps(inv2);
    for (int32_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
        _mm_mask_storeu_epi8(q1 + i, lanes, encode16(code1, _mm512_mul_ps(_mm512_load_ps(m_new + i), vinv1), lanes));
        _mm_mask_storeu_epi8(q2 + i, lanes, encode16(code2, _mm512_mul_ps(_mm512_load_ps(v_new + i), vinv2), lanes));
    }
    *s1 = max1, *s2 = max2;
}
#endif

// bf16 moments: elementwise, with the stochastic rounding of element index + i (32-bit arithmetic: the hash takes
// the index mod 2^32, and 64-bit lanes would halve the vector width).
template <typename G>
void bf16m_run(uint16_t* p, uint16_t* c, uint16_t* m16, uint16_t* v16, const G* g, int32_t n, int32_t decay_n,
               uint32_t index, uint32_t key, const Constants& k) {
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) {
        const float grad = load(g, i) * k.coef;
        const float m_old = bf16_to_float(m16[i]), v_old = bf16_to_float(v16[i]);
        const float m = m_old + (grad - m_old) * k.omb1;
        const float v = v_old * k.b2 + (grad * k.omb2) * grad;
        update_weight(p, c, i, m, v, i < decay_n, k);
        const uint32_t noise = mix32((index + static_cast<uint32_t>(i)) ^ key);
        m16[i] = float_to_bf16_stochastic(m, noise & 0xffffu);
        v16[i] = float_to_bf16_stochastic(v, noise >> 16);
    }
}

template <typename G, bool Q8>
void lean(uint16_t* p, uint16_t* c, void* m, void* v, float* s1, float* s2, const G* g, int64_t n, int64_t index,
          int64_t decay_n, const Constants& k, int64_t block, const Code& code1, const Code& code2, uint32_t key,
          int threads) {
    const int64_t run = Q8 ? block : (1 << 14);
    const int64_t runs = (n + run - 1) / run;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < runs; ++r) {
        const int64_t a = r * run, len = a + run < n ? run : n - a;
        const int32_t dn = static_cast<int32_t>(decay_n - a < 0 ? 0 : (decay_n - a > len ? len : decay_n - a));
        if constexpr (Q8)
#if MEGATRAIN_LEAN_AVX512
            q8_block_avx512<G>(p + a, c + a, static_cast<uint8_t*>(m) + a, static_cast<uint8_t*>(v) + a, s1 + r, s2 + r,
                        g + a, static_cast<int32_t>(len), dn, k, code1, code2);
#else
            q8_block<G>(p + a, c + a, static_cast<uint8_t*>(m) + a, static_cast<uint8_t*>(v) + a, s1 + r, s2 + r,
                        g + a, static_cast<int32_t>(len), dn, k, code1, code2);
#endif
        else
            bf16m_run<G>(p + a, c + a, static_cast<uint16_t*>(m) + a, static_cast<uint16_t*>(v) + a, g + a,
                         static_cast<int32_t>(len), dn, static_cast<uint32_t>(index + a), key, k);
    }
}

}  // namespace

extern "C" {

// The span [index, index + n) of a stage: element 0 at `p` (with int8 moments on a block, its scales at s1, s2),
// the first `decay_n` elements with weight decay. The constants are optim/lean_adamw.LeanConstants.
#define MEGATRAIN_LEAN(NAME, G, Q8)                                                                               \
    void NAME(uint16_t* p, uint16_t* c, void* m, void* v, float* s1, float* s2, const G* g, int64_t n,            \
              int64_t index, int64_t decay_n, float omb1, float b2, float omb2, float eps, float bc2_sqrt,        \
              float step, float decay, float coef, int block, const float* values1, const uint32_t* prefix1,     \
              int zero1, const float* values2, const uint32_t* prefix2, int zero2, uint32_t key, int threads) {  \
        const Constants k{omb1, b2, omb2, eps, bc2_sqrt, step, decay, coef};                                      \
        const Code code1{values1, prefix1, static_cast<uint32_t>(zero1)};                                         \
        const Code code2{values2, prefix2, static_cast<uint32_t>(zero2)};                                         \
        if (Q8 && (block < 1 || block > 2048)) return;                                                            \
        lean<G, Q8>(p, c, m, v, s1, s2, g, n, index, decay_n, k, block, code1, code2, key, threads);              \
    }
MEGATRAIN_LEAN(megatrain_lean_adamw_f32grad_q8, float, true)
MEGATRAIN_LEAN(megatrain_lean_adamw_bf16grad_q8, uint16_t, true)
MEGATRAIN_LEAN(megatrain_lean_adamw_f32grad_bf16m, float, false)
MEGATRAIN_LEAN(megatrain_lean_adamw_bf16grad_bf16m, uint16_t, false)
#undef MEGATRAIN_LEAN

}
