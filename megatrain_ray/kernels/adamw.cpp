// One-pass AdamW over a flat fp32 span, for the CPU optimizer workers.
//
// Per element: read the gradient (fp32 or bf16), master weight and both moments; write the
// weight, the moments and, when asked, the bf16 streaming copy. 28 bytes per parameter with
// bf16 gradients and copy, the least DRAM traffic AdamW allows (DESIGN.md section 3). The math
// is torch.optim.AdamW's (decoupled weight decay, bias corrections), in the order of torch's
// fused CPU kernel. The gradient may be the streaming copy itself (bf16 gradients land there),
// so `g` and `out` may alias: element i is read before it is written. Built by
// megatrain_ray/kernels/__init__.py and called through ctypes, which releases the GIL.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

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

template <typename G>
inline float load(const G* g, int64_t i);
template <>
inline float load<float>(const float* g, int64_t i) { return g[i]; }
template <>
inline float load<uint16_t>(const uint16_t* g, int64_t i) { return bf16_to_float(g[i]); }

template <typename G, bool WriteCopy>
void adamw_block(float* __restrict p, float* __restrict m, float* __restrict v, const G* g, uint16_t* out,
                 int64_t n, float decay, float step_size, float beta1, float beta2, float eps,
                 float bias_correction2_sqrt, float grad_coef) {
    const float one_minus_b1 = 1.0f - beta1, one_minus_b2 = 1.0f - beta2;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float grad = load(g, i) * grad_coef;
        const float exp_avg = m[i] + one_minus_b1 * (grad - m[i]);
        const float exp_avg_sq = beta2 * v[i] + one_minus_b2 * grad * grad;
        const float denom = std::sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
        const float updated = p[i] * decay - step_size * exp_avg / denom;
        m[i] = exp_avg;
        v[i] = exp_avg_sq;
        p[i] = updated;
        if constexpr (WriteCopy) out[i] = float_to_bf16(updated);
    }
}

template <typename G>
void adamw(float* p, float* m, float* v, const G* g, uint16_t* out, int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, float bias_correction1, float bias_correction2_sqrt, float grad_coef,
           int threads) {
    const float decay = 1.0f - lr * weight_decay;
    const float step_size = lr / bias_correction1;
    const int64_t block = 1 << 14;  // 16K elements: a few blocks per thread stay in L2
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t start = 0; start < n; start += block) {
        const int64_t len = start + block < n ? block : n - start;
        if (out)
            adamw_block<G, true>(p + start, m + start, v + start, g + start, out + start, len, decay, step_size,
                                 beta1, beta2, eps, bias_correction2_sqrt, grad_coef);
        else
            adamw_block<G, false>(p + start, m + start, v + start, g + start, nullptr, len, decay, step_size,
                                  beta1, beta2, eps, bias_correction2_sqrt, grad_coef);
    }
}

}  // namespace

extern "C" {

void megatrain_adamw_f32grad(float* p, float* m, float* v, const float* g, uint16_t* out, int64_t n, float lr,
                             float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2_sqrt,
                             float grad_coef, int threads) {
    adamw<float>(p, m, v, g, out, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt, grad_coef, threads);
}

void megatrain_adamw_bf16grad(float* p, float* m, float* v, const uint16_t* g, uint16_t* out, int64_t n, float lr,
                              float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2_sqrt,
                              float grad_coef, int threads) {
    adamw<uint16_t>(p, m, v, g, out, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt, grad_coef, threads);
}

}
