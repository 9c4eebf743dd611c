/* What zero.optim._adam_kernel's two steps share, the exact one (adam_kernel.c) and the compact formats'
 * (compact_kernel.c): a call's Step, its hyperparameters derived as torch derives them, the bf16/fp16 conversions,
 * the scalar loop, and the split of a range into torch's vector and tail rounding (`step_range`). The vector loops
 * live in adam_kernel.c, which picks one at import (`adam_best_span`). See adam_kernel.c for why the arithmetic is
 * written this way. */
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

/* Elements [lo, hi) rounded as torch's vector loop rounds: the vector loop, then the scalar loop for the rest. */
static void body_span(const Step *s, int64_t lo, int64_t hi, VectorSpan vector_span) {
    Step part = *s;
    part.p += lo, part.g += lo, part.m += lo, part.v += lo;
    if (part.o) part.o += lo;
    int64_t done = vector_span ? vector_span(&part, hi - lo) : 0;
    scalar_span(&part, done, hi - lo, 0);
}

/* Elements [lo, hi): the parts of the `count` tail spans ((start, stop) pairs, sorted and disjoint, counted from
 * `origin`: the element s's arrays start at is element `origin` of the spans' count) among them rounded as torch's
 * scalar tail rounds, the rest as its vector loop does. */
static void step_range(const Step *s, int64_t lo, int64_t hi, const int64_t *tails, int64_t count, int64_t origin,
                       VectorSpan vector_span) {
    for (int64_t k = 0; k < count && lo < hi; k++) {
        int64_t start = tails[2 * k] - origin, stop = tails[2 * k + 1] - origin;
        if (start >= hi) break; /* sorted: the rest lie beyond [lo, hi) too */
        start = start > lo ? start : lo, stop = stop < hi ? stop : hi;
        if (stop <= start) continue;
        body_span(s, lo, start, vector_span);
        scalar_span(s, start, stop, 1);
        lo = stop;
    }
    body_span(s, lo, hi, vector_span);
}

#endif
