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

namespace {

#include "bf16.h"

struct Constants {
    float omb1, b2, omb2, eps, bc2_sqrt, step, decay, coef;
};

// One moment map (optim/quant8.ByteCode): value of each stored byte, the 255 sorted midpoints, per 16-bit prefix of a
// float the midpoints below all of its floats (no prefix spans two: quant8.prefix_counts checks), the index of 0.0.
struct Code {
    const float* values;
    const float* bounds;
    const int32_t* below;  // 256 KB, in L2; int32 so that the encoding loop vectorizes (gathers)
    int zero;
    // The stored byte of scaled value x: the number of midpoints below x (the prefix's count, plus one if the next
    // midpoint is below x too), minus zero, mod 256. Branch-free: a binary search's branches mispredict on every
    // other step (measured: 0.32 G params/s on 16 cores against 4.4 for the full state).
    inline uint8_t encode(float x) const {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        const int32_t l = below[bits >> 16];
        const int32_t pos = l + static_cast<int32_t>((l < 255) & (bounds[l < 255 ? l : 254] < x));
        return static_cast<uint8_t>((pos - zero) & 0xff);
    }
};

// The update of one element from its float32 moments; writes master and compensation.
inline void update_weight(uint16_t* p, uint16_t* c, int64_t i, float m, float v, bool decayed, const Constants& k) {
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
// scales, `decay_n` of its elements (from the first) with weight decay.
template <typename G>
void q8_block(uint16_t* p, uint16_t* c, uint8_t* q1, uint8_t* q2, float* s1, float* s2, const G* g, int64_t n,
              int64_t decay_n, const Constants& k, const Code& code1, const Code& code2) {
    float m_new[2048], v_new[2048];
    const float scale1 = *s1, scale2 = *s2;
    // The absmax as the largest bit pattern of |m|: for non-negative floats integer order is float order, an
    // integer max reduction vectorizes (a float one needs -ffinite-math-only), and a NaN wins, as in torch's amax.
    uint32_t top1 = 0, top2 = 0;
#pragma omp simd reduction(max : top1, top2)
    for (int64_t i = 0; i < n; ++i) {
        const float grad = load(g, i) * k.coef;
        const float m_old = code1.values[q1[i]] * scale1, v_old = code2.values[q2[i]] * scale2;
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
    for (int64_t i = 0; i < n; ++i) update_weight(p, c, i, m_new[i], v_new[i], i < decay_n, k);
    float max1, max2;
    std::memcpy(&max1, &top1, sizeof max1);
    std::memcpy(&max2, &top2, sizeof max2);
    const float inv1 = max1 > 0.0f ? 1.0f / max1 : 0.0f, inv2 = max2 > 0.0f ? 1.0f / max2 : 0.0f;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        q1[i] = code1.encode(m_new[i] * inv1);
        q2[i] = code2.encode(v_new[i] * inv2);
    }
    *s1 = max1, *s2 = max2;
}

// bf16 moments: elementwise, with the stochastic rounding of element index + i.
template <typename G>
void bf16m_run(uint16_t* p, uint16_t* c, uint16_t* m16, uint16_t* v16, const G* g, int64_t n, int64_t decay_n,
               int64_t index, uint32_t key, const Constants& k) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float grad = load(g, i) * k.coef;
        const float m_old = bf16_to_float(m16[i]), v_old = bf16_to_float(v16[i]);
        const float m = m_old + (grad - m_old) * k.omb1;
        const float v = v_old * k.b2 + (grad * k.omb2) * grad;
        update_weight(p, c, i, m, v, i < decay_n, k);
        const uint32_t noise = mix32(static_cast<uint32_t>(index + i) ^ key);
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
        const int64_t dn = decay_n - a < 0 ? 0 : (decay_n - a > len ? len : decay_n - a);
        if constexpr (Q8)
            q8_block<G>(p + a, c + a, static_cast<uint8_t*>(m) + a, static_cast<uint8_t*>(v) + a, s1 + r, s2 + r,
                        g + a, len, dn, k, code1, code2);
        else
            bf16m_run<G>(p + a, c + a, static_cast<uint16_t*>(m) + a, static_cast<uint16_t*>(v) + a, g + a, len, dn,
                         index + a, key, k);
    }
}

}  // namespace

extern "C" {

// The span [index, index + n) of a stage: element 0 at `p` (with int8 moments on a block, its scales at s1, s2),
// the first `decay_n` elements with weight decay. The constants are optim/lean_adamw.LeanConstants.
#define MEGATRAIN_LEAN(NAME, G, Q8)                                                                               \
    void NAME(uint16_t* p, uint16_t* c, void* m, void* v, float* s1, float* s2, const G* g, int64_t n,            \
              int64_t index, int64_t decay_n, float omb1, float b2, float omb2, float eps, float bc2_sqrt,        \
              float step, float decay, float coef, int block, const float* values1, const float* bounds1,       \
              const int32_t* below1, int zero1, const float* values2, const float* bounds2, const int32_t* below2, \
              int zero2, uint32_t key, int threads) {                                                             \
        const Constants k{omb1, b2, omb2, eps, bc2_sqrt, step, decay, coef};                                      \
        const Code code1{values1, bounds1, below1, zero1}, code2{values2, bounds2, below2, zero2};                \
        if (Q8 && (block < 1 || block > 2048)) return;                                                            \
        lean<G, Q8>(p, c, m, v, s1, s2, g, n, index, decay_n, k, block, code1, code2, key, threads);              \
    }
MEGATRAIN_LEAN(megatrain_lean_adamw_f32grad_q8, float, true)
MEGATRAIN_LEAN(megatrain_lean_adamw_bf16grad_q8, uint16_t, true)
MEGATRAIN_LEAN(megatrain_lean_adamw_f32grad_bf16m, float, false)
MEGATRAIN_LEAN(megatrain_lean_adamw_bf16grad_bf16m, uint16_t, false)
#undef MEGATRAIN_LEAN

}
