// One-pass AdamW over a flat fp32 span, for the CPU optimizer workers.
//
// Per element: read the gradient (fp32 or bf16), master weight and both moments; write the
// weight, the moments and, when asked, the bf16 streaming copy. 28 bytes per parameter with
// bf16 gradients and copy, the least DRAM traffic AdamW allows (docs/speed-model.md). The math
// is torch.optim.AdamW's (decoupled weight decay, bias corrections), in the order of torch's
// fused CPU kernel. The gradient may be the streaming copy itself (bf16 gradients land there),
// so `g` and `out` may alias: element i is read before it is written. Built by
// megatrain_ray/optim/kernels/__init__.py and called through ctypes, which releases the GIL.
//
// The *_bf16m variants keep both moments in bf16 (20 bytes per parameter): each is widened to
// fp32, updated, and rounded back stochastically, with 16 bits of noise from a hash of the
// element's index in the stage and a per-(step, stage) key: the same rounding as the torch path
// of megatrain_ray/optim/adamw.py (see there why stochastic), bit for bit for numbers (a NaN stays a NaN).
//
// A speculative update (optimizer.speculative_stages: before the step's gradient norm is known) reads the stage's
// current master weights and moments and writes the new ones into its other set (`*_new`), so that the current set
// stays for a redo; it also saves the gradient (`g_saved`), which the streaming copy it may sit in is about to lose.
// Null `*_new` pointers: in place. The other set is not in cache: on x86 (SSE2 or AVX-512) each sub-block of 256
// elements is computed into scratch that stays in L1 and streamed out with non-temporal stores, so its lines are not
// read first: with bf16 gradients 30 bytes per parameter, 2 more than in place (the saved gradient). Plain stores
// there read each line first (42 bytes); on the H200 box's Xeon (benchmarks/optimizer_scaling.py --speculative) they
// ran at about 0.65 of the in-place rate, the streamed sub-blocks at about 0.9; on a 2-core AMD EPYC VM at 0.65 and
// 0.79. Elsewhere the other set is written directly (megatrain_adamw_streams() says which). In place, streaming the
// lines back did not pay (they are in cache already, read by the update).
#include <cmath>
#include <cstdint>
#include <cstring>
// Bytes per non-temporal store (stream_copy); 0: the CPU has none this file uses.
#if defined(__AVX512F__)
#include <immintrin.h>
#define MEGATRAIN_STREAM_WIDTH 64
#elif defined(__SSE2__)
#include <emmintrin.h>
#define MEGATRAIN_STREAM_WIDTH 16
#else
#define MEGATRAIN_STREAM_WIDTH 0
#endif

namespace {

#include "bf16.h"

constexpr bool kStreams = MEGATRAIN_STREAM_WIDTH > 0;

// Copy with non-temporal stores where the CPU has them (whole lines with AVX-512): what a speculative update writes
// (its saved gradient, the other set) is not read again this step, so its lines go to DRAM without being read
// first (as a plain store does) or evicting the block the update is about to read. Partial lines at either end are
// plain stores. Ordered by the sfence at the end of the block. Without SSE2 or AVX-512: a plain copy.
inline void stream_copy(void* dst, const void* src, int64_t bytes) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
#if MEGATRAIN_STREAM_WIDTH
    constexpr int64_t width = MEGATRAIN_STREAM_WIDTH;
    int64_t head = static_cast<int64_t>((width - (reinterpret_cast<uintptr_t>(d) & (width - 1))) & (width - 1));
    head = head < bytes ? head : bytes;
    std::memcpy(d, s, static_cast<size_t>(head));
    d += head, s += head, bytes -= head;
    for (; bytes >= width; bytes -= width, d += width, s += width)
#if MEGATRAIN_STREAM_WIDTH == 64
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#else
        _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#endif
#endif
    std::memcpy(d, s, static_cast<size_t>(bytes));
}

// Where an update writes (the current set itself, or the stage's other set) and where it saves the gradient.
template <typename G, typename M>
struct Outputs {
    float* p;
    M* m;
    M* v;
    G* g_saved;
    Outputs at(int64_t start) const { return {p + start, m + start, v + start, g_saved ? g_saved + start : nullptr}; }
};

// G: gradient element (float or bf16 bits); M: moment element (float, or bf16 bits rounded stochastically).
// `index` is the index in the stage of element 0, `key` the noise key of this (step, stage). Element i is read
// before it is written, so `to` may be the current set itself (and `out` the gradient).
template <typename G, typename M, bool WriteCopy>
void adamw_elements(const float* p, const M* m, const M* v, const G* g, uint16_t* out, Outputs<G, M> to,
                    int64_t n, float decay, float step_size, float one_minus_b1, float beta2, float one_minus_b2,
                    float eps, float bias_correction2_sqrt, float grad_coef, int64_t index, uint32_t key) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float grad = load(g, i) * grad_coef;
        const float m_old = load(m, i), v_old = load(v, i);
        const float exp_avg = m_old + one_minus_b1 * (grad - m_old);
        const float exp_avg_sq = beta2 * v_old + one_minus_b2 * grad * grad;
        const float denom = std::sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
        const float updated = p[i] * decay - step_size * exp_avg / denom;
        if constexpr (sizeof(M) == 2) {
            const uint32_t noise = mix32(static_cast<uint32_t>(index + i) ^ key);
            to.m[i] = float_to_bf16_stochastic(exp_avg, noise & 0xffffu);
            to.v[i] = float_to_bf16_stochastic(exp_avg_sq, noise >> 16);
        } else {
            to.m[i] = exp_avg;
            to.v[i] = exp_avg_sq;
        }
        to.p[i] = updated;
        if constexpr (WriteCopy) out[i] = float_to_bf16(updated);
    }
}

constexpr int64_t kScratchElements = 256;  // a speculative update's sub-block: 3 KB of scratch with fp32 state, in L1

// One block of an update: in place, or into the other set through scratch streamed out (see the top of the file).
template <typename G, typename M, bool WriteCopy>
void adamw_block(const float* p, const M* m, const M* v, const G* g, uint16_t* out, Outputs<G, M> to,
                 int64_t n, float decay, float step_size, float one_minus_b1, float beta2, float one_minus_b2,
                 float eps, float bias_correction2_sqrt, float grad_coef, int64_t index, uint32_t key) {
    if (to.g_saved)  // before the streaming copy is written; the block is then in cache for the update
        stream_copy(to.g_saved, g, n * static_cast<int64_t>(sizeof(G)));
    if (to.p == p || !kStreams) {  // in place, or into the other set with plain stores
        adamw_elements<G, M, WriteCopy>(p, m, v, g, out, to, n, decay, step_size, one_minus_b1, beta2, one_minus_b2,
                                        eps, bias_correction2_sqrt, grad_coef, index, key);
    } else {
        alignas(64) float p_new[kScratchElements];
        alignas(64) M m_new[kScratchElements], v_new[kScratchElements];
        const Outputs<G, M> scratch{p_new, m_new, v_new, nullptr};
        for (int64_t a = 0; a < n; a += kScratchElements) {
            const int64_t k = n - a < kScratchElements ? n - a : kScratchElements;
            adamw_elements<G, M, WriteCopy>(p + a, m + a, v + a, g + a, WriteCopy ? out + a : nullptr, scratch, k,
                                            decay, step_size, one_minus_b1, beta2, one_minus_b2, eps,
                                            bias_correction2_sqrt, grad_coef, index + a, key);
            stream_copy(to.p + a, p_new, k * static_cast<int64_t>(sizeof(float)));
            stream_copy(to.m + a, m_new, k * static_cast<int64_t>(sizeof(M)));
            stream_copy(to.v + a, v_new, k * static_cast<int64_t>(sizeof(M)));
        }
    }
#if MEGATRAIN_STREAM_WIDTH
    if (to.g_saved || to.p != p) _mm_sfence();  // the streamed stores visible to other cores before the block returns
#endif
}

// beta1 and beta2 come in double, as torch's kernel takes them: 1 - beta is rounded to float once, from
// the exact value (1.0f - 0.999f is 13 float32 ulps away from 0.001f).
template <typename G, typename M>
void adamw(const float* p, const M* m, const M* v, const G* g, uint16_t* out, Outputs<G, M> to, int64_t n, float lr,
           double beta1, double beta2, float eps, float weight_decay, float bias_correction1,
           float bias_correction2_sqrt, float grad_coef, int threads, int64_t index, uint32_t key) {
    const float decay = 1.0f - lr * weight_decay;
    const float step_size = lr / bias_correction1;
    const float one_minus_b1 = static_cast<float>(1.0 - beta1), one_minus_b2 = static_cast<float>(1.0 - beta2);
    const float b2 = static_cast<float>(beta2);
    const int64_t block = 1 << 14;  // 16K elements: a few blocks per thread stay in L2
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t start = 0; start < n; start += block) {
        const int64_t len = start + block < n ? block : n - start;
        if (out)
            adamw_block<G, M, true>(p + start, m + start, v + start, g + start, out + start, to.at(start), len, decay,
                                    step_size, one_minus_b1, b2, one_minus_b2, eps, bias_correction2_sqrt, grad_coef,
                                    index + start, key);
        else
            adamw_block<G, M, false>(p + start, m + start, v + start, g + start, nullptr, to.at(start), len, decay,
                                     step_size, one_minus_b1, b2, one_minus_b2, eps, bias_correction2_sqrt,
                                     grad_coef, index + start, key);
    }
}

}  // namespace

extern "C" {

// Whether a speculative update streams its other set out (30 bytes per parameter with bf16 gradients) or writes it
// with plain stores (42): FlatAdamW.bytes_per_element.
int megatrain_adamw_streams() { return kStreams ? 1 : 0; }

// Every variant takes the index of element 0 in its stage and the noise key (used by the bf16-moment ones), then
// where a speculative update writes (null: in place) and saves the gradient (null: nowhere).
#define MEGATRAIN_ADAMW(NAME, G, M)                                                                               \
    void NAME(float* p, M* m, M* v, const G* g, uint16_t* out, int64_t n, float lr, double beta1, double beta2,   \
              float eps, float weight_decay, float bc1, float bc2_sqrt, float grad_coef, int threads, int64_t index, \
              uint32_t key, float* p_new, M* m_new, M* v_new, G* g_saved) {                                     \
        const Outputs<G, M> to = p_new ? Outputs<G, M>{p_new, m_new, v_new, g_saved}                              \
                                       : Outputs<G, M>{p, m, v, g_saved};                                         \
        adamw<G, M>(p, m, v, g, out, to, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt, grad_coef,        \
                    threads, index, key);                                                                         \
    }
MEGATRAIN_ADAMW(megatrain_adamw_f32grad, float, float)
MEGATRAIN_ADAMW(megatrain_adamw_bf16grad, uint16_t, float)
MEGATRAIN_ADAMW(megatrain_adamw_f32grad_bf16m, float, uint16_t)
MEGATRAIN_ADAMW(megatrain_adamw_bf16grad_bf16m, uint16_t, uint16_t)
#undef MEGATRAIN_ADAMW

}
