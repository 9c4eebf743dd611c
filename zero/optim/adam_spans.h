/* The Adam arithmetic of zero.optim._adam_kernel over flat fp32 arrays, shared by its two steps: the exact one
 * (adam_kernel.c) and the compact formats' (compact_kernel.c). See adam_kernel.c for why it is written this way. */
#ifndef ZERO_ADAM_SPANS_H
#define ZERO_ADAM_SPANS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { OUT_NONE = 0, OUT_BF16 = 1, OUT_FP16 = 2 };

/* One call's arrays and hyperparameters, in the float form the element loops use. */
typedef struct {
    float *p, *g, *m, *v;
    uint16_t *o;
    int out;     /* OUT_NONE, OUT_BF16 or OUT_FP16 */
    int scaled;  /* grad_scale != 1: divide grad by inv_scale and store it back */
    int adam_wd; /* Adam's weight decay, added to the grad (AdamW's is `decay`, 1 without) */
    int small;   /* |1 - beta1| < 0.5: which of torch's two lerp formulas `coeff` belongs to */
    float inv_scale, wd, decay, coeff, beta2, c2, bc2_sqrt, eps, neg_step;
} Step;

/* torch's float -> bfloat16 as its vectorized conversion does it: round to nearest even; every NaN 0xFFFF. */
static inline uint16_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return x != x ? 0xFFFF : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float -> IEEE half as x86's vcvtps2ph (which torch's conversion uses) does it: round to nearest even,
 * subnormal halves kept, NaN quieted with its top payload bits. */
static inline uint16_t fp16_bits(float x) {
    uint32_t u, a, s;
    memcpy(&u, &x, 4);
    a = u & 0x7FFFFFFFu;
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u), h;
    if (a > 0x7F800000u) {
        h = (uint16_t)(0x7E00u | ((a >> 13) & 0x3FFu));
    } else if (a >= 0x477FF000u) { /* rounds past 65504: infinity */
        h = 0x7C00u;
    } else if (a < 0x38800000u) { /* below 2^-14: a multiple of 2^-24, rounded by adding 0.5f */
        float sum;
        memcpy(&sum, &a, 4);
        sum += 0.5f;
        memcpy(&s, &sum, 4);
        h = (uint16_t)(s - 0x3F000000u);
    } else {
        a -= 0x38000000u; /* rebias the exponent from 127 to 15 */
        h = (uint16_t)((a + 0xFFFu + ((a >> 13) & 1u)) >> 13);
    }
    return sign | h;
}

/* Elements [begin, end) one at a time. torch's vector loop (8 wide) computes exp_avg_sq as
 * fma(c2 * g, g, v * beta2); its scalar tail, the last numel % 8 elements, as fma(v, beta2, c2 * g * g):
 * `tail` says which of the two these elements get. Every other operation rounds the same in both. */
static void scalar_span(const Step *args, int64_t begin, int64_t end, int tail) {
    const Step c = *args, *s = &c; /* a local copy: stores through the arrays cannot alias its fields */
    for (int64_t i = begin; i < end; i++) {
        float g = s->g[i];
        if (s->scaled) {
            g = g / s->inv_scale;
            s->g[i] = g;
        }
        float p = s->p[i];
        if (s->adam_wd) g = fmaf(p, s->wd, g);
        p = p * s->decay;
        float m = s->m[i];
        m = fmaf(s->coeff, g - m, s->small ? m : g);
        float v = s->v[i];
        v = tail ? fmaf(v, s->beta2, s->c2 * g * g) : fmaf(s->c2 * g, g, v * s->beta2);
        s->m[i] = m;
        s->v[i] = v;
        p = p + s->neg_step * m / (sqrtf(v) / s->bc2_sqrt + s->eps);
        s->p[i] = p;
        if (s->out == OUT_BF16) s->o[i] = bf16_bits(p);
        else if (s->out == OUT_FP16) s->o[i] = fp16_bits(p);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86_PATHS 1

/* The same arithmetic 16 at a time; returns how many elements it did (a multiple of 16). The copy-out,
 * where aligned, goes out with non-temporal stores: nothing here reads it back, and they spare reading its
 * lines into the cache before writing them (2 of the 32 bytes a parameter costs). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
static int64_t avx512_span(const Step *args, int64_t n) {
    const Step c = *args, *s = &c;
    const __m512 inv_scale = _mm512_set1_ps(s->inv_scale), wd = _mm512_set1_ps(s->wd);
    const __m512 decay = _mm512_set1_ps(s->decay), coeff = _mm512_set1_ps(s->coeff);
    const __m512 beta2 = _mm512_set1_ps(s->beta2), c2 = _mm512_set1_ps(s->c2);
    const __m512 bc2_sqrt = _mm512_set1_ps(s->bc2_sqrt), eps = _mm512_set1_ps(s->eps);
    const __m512 neg_step = _mm512_set1_ps(s->neg_step);
    const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0xFFFF);
    const int stream = s->out != OUT_NONE && ((uintptr_t)s->o & 31) == 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(s->g + i);
        if (s->scaled) {
            g = _mm512_div_ps(g, inv_scale);
            _mm512_storeu_ps(s->g + i, g);
        }
        __m512 p = _mm512_loadu_ps(s->p + i);
        if (s->adam_wd) g = _mm512_fmadd_ps(p, wd, g);
        p = _mm512_mul_ps(p, decay);
        __m512 m = _mm512_loadu_ps(s->m + i);
        m = _mm512_fmadd_ps(coeff, _mm512_sub_ps(g, m), s->small ? m : g);
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s->v + i), beta2);
        v = _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, v);
        _mm512_storeu_ps(s->m + i, m);
        _mm512_storeu_ps(s->v + i, v);
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
        _mm512_storeu_ps(s->p + i, p);
        if (s->out != OUT_NONE) {
            __m256i half;
            if (s->out == OUT_BF16) {
                __m512i u = _mm512_castps_si512(p);
                __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
                r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), nan);
                half = _mm512_cvtepi32_epi16(r);
            } else {
                half = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            }
            if (stream) _mm256_stream_si256((__m256i *)(s->o + i), half);
            else _mm256_storeu_si256((__m256i *)(s->o + i), half);
        }
    }
    if (stream) _mm_sfence(); /* the streamed copy-out is visible before the GIL is taken back */
    return i;
}

/* The same arithmetic 8 at a time, the copy-out streamed as above; returns how many elements it did. */
__attribute__((target("avx2,fma,f16c")))
static int64_t avx2_span(const Step *args, int64_t n) {
    const Step c = *args, *s = &c;
    const __m256 inv_scale = _mm256_set1_ps(s->inv_scale), wd = _mm256_set1_ps(s->wd);
    const __m256 decay = _mm256_set1_ps(s->decay), coeff = _mm256_set1_ps(s->coeff);
    const __m256 beta2 = _mm256_set1_ps(s->beta2), c2 = _mm256_set1_ps(s->c2);
    const __m256 bc2_sqrt = _mm256_set1_ps(s->bc2_sqrt), eps = _mm256_set1_ps(s->eps);
    const __m256 neg_step = _mm256_set1_ps(s->neg_step);
    const __m256i round = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0xFFFF);
    const int stream = s->out != OUT_NONE && ((uintptr_t)s->o & 15) == 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(s->g + i);
        if (s->scaled) {
            g = _mm256_div_ps(g, inv_scale);
            _mm256_storeu_ps(s->g + i, g);
        }
        __m256 p = _mm256_loadu_ps(s->p + i);
        if (s->adam_wd) g = _mm256_fmadd_ps(p, wd, g);
        p = _mm256_mul_ps(p, decay);
        __m256 m = _mm256_loadu_ps(s->m + i);
        m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), s->small ? m : g);
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s->v + i), beta2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, v);
        _mm256_storeu_ps(s->m + i, m);
        _mm256_storeu_ps(s->v + i, v);
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
        _mm256_storeu_ps(s->p + i, p);
        if (s->out != OUT_NONE) {
            __m128i half;
            if (s->out == OUT_BF16) {
                __m256i u = _mm256_castps_si256(p);
                __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
                r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), nan, _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
                half = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            } else {
                half = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            }
            if (stream) _mm_stream_si128((__m128i *)(s->o + i), half);
            else _mm_storeu_si128((__m128i *)(s->o + i), half);
        }
    }
    if (stream) _mm_sfence();
    return i;
}
#endif

typedef int64_t (*VectorSpan)(const Step *, int64_t);

/* The Step of one call, its hyperparameters derived as torch derives them: step as a float, the bias corrections in
 * double, each factor rounded to float. The arrays are left for the caller to set. */
static inline Step derive_step(long long step_count, double lr, double beta1, double beta2, double eps,
                               double weight_decay, int decoupled, double grad_scale) {
    double t = (double)(float)step_count;
    float w = (float)(1 - beta1);
    Step s = {
        .scaled = grad_scale != 1.0, .adam_wd = !decoupled && weight_decay != 0,
        .small = fabsf(w) < 0.5f,
        .inv_scale = (float)(1.0 / grad_scale),
        .wd = (float)weight_decay,
        .decay = decoupled && weight_decay != 0 ? (float)fma(-lr, weight_decay, 1.0) : 1.0f, /* fused, as torch's */
        /* exp_avg.lerp_(grad, w): exp_avg + w * (grad - exp_avg) for small w, else grad + (w - 1) * (grad - exp_avg) */
        .coeff = fabsf(w) < 0.5f ? w : w - 1.0f,
        .beta2 = (float)beta2,
        .c2 = (float)(1 - beta2),
        .bc2_sqrt = (float)sqrt(1 - pow(beta2, t)),
        .eps = (float)eps,
        .neg_step = (float)-(lr / (1 - pow(beta1, t))),
    };
    return s;
}

/* The best vector loop this CPU runs (adam_kernel.c picks it at import; NULL: the scalar loop alone). */
VectorSpan adam_best_span(void);

#endif
