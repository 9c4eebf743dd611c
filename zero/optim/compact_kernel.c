/* The Adam step of a sub-group stored in a compact state format (zero/optim/state_format.py), one pass: for each
 * block of 256 elements, decode the master and moments into one block's buffers on the stack, run the exact
 * kernel's Adam arithmetic (adam_spans.h: torch's fused kernel bit for bit, its scalar tail for the sub-group's
 * last numel % 8 elements), encode them back and write the compute-dtype copy. zero/optim/compact_step.py's
 * torch version computes the same bits; the tests compare the two.
 *
 * Storage kinds: 0 fp32 (stepped in place), 1 bf16 (rounded to nearest even; a master with `stochastic`:
 * 16 random bits added below its bf16 part, then truncated), 2 and 3 block-wise int8, signed and unsigned: the
 * segment holds one fp32 absmax per 256-element block, then one code per element; a value is map[code] * absmax,
 * and encoding picks the nearest code (the count of midpoints below value / absmax: one read of the map's bucket
 * table and one comparison, see Maps). A block whose absmax is below 2^-100 is stored as zeros (absmax 0, codes 0).
 * A bf16 master with a `compensation` (bf16-kahan, state_format.py's Kahan) is its weights plus the compensation,
 * summed in fp32; encoded, the weights and the remainder round to nearest, twice (see kahan_encode). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <time.h>

#include "adam_spans.h"

enum { STORE_FP32 = 0, STORE_BF16 = 1, STORE_INT8_SIGNED = 2, STORE_INT8_UNSIGNED = 3 };
#define QBLOCK 256
#define TINY 0x1p-100f

typedef struct {
    /* [0] signed, [1] unsigned: 256 values, and for each of the 2^17 buckets of floats sharing their top 17 bits
     * (sign, exponent, 8 bits of mantissa) one entry (state_format.py's buckets): bits 0-7 how many midpoints lie
     * below the bucket, bit 8 whether the bucket holds the next one, bits 16-30 its low 15 bits. No bucket holds
     * two midpoints, so comparing with that one finishes the count. */
    const float *values[2];
    const uint32_t *buckets[2];
} Maps;

/* A 32-bit integer hash (Chris Wellons' lowbias32); compact_step.py's `_mix` computes the same. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

static inline int64_t blocks_of(int64_t numel) { return (numel + QBLOCK - 1) / QBLOCK; }

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_CODECS 1

/* The int8 and bf16 codecs' loops 8 elements at a time, the same operations as the scalar ones above (so the same
 * bits); each returns how many elements it did, a multiple of 8, the caller finishing the rest. The int8 ones read
 * their tables with `gathers` (one instruction for 8 reads) or with 8 scalar loads: gathers are microcoded and the
 * slower on some CPUs (AMD Zen 1: scalar loads made the int8 step 1.7x faster), so compact_init times both. */
__attribute__((target("avx2,fma")))
static int int8_decode_avx2(const uint8_t *codes, int n, const float *map, float absmax, float *out, int gathers) {
    const __m256 a = _mm256_set1_ps(absmax);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x;
        if (gathers)
            x = _mm256_i32gather_ps(map, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i))), 4);
        else
            x = _mm256_setr_ps(map[codes[i]], map[codes[i + 1]], map[codes[i + 2]], map[codes[i + 3]],
                               map[codes[i + 4]], map[codes[i + 5]], map[codes[i + 6]], map[codes[i + 7]]);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(x, a));
    }
    return i;
}

/* The largest |x| of in[0, n) not NaN, and whether a NaN was seen; returns how many elements it read. */
__attribute__((target("avx2,fma")))
static int absmax_avx2(const float *in, int n, float *absmax, int *nan) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_and_ps(_mm256_loadu_ps(in + i), magnitude);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        top = _mm256_max_ps(x, top); /* a NaN x gives top back */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int k = 0; k < 8; k++)
        if (lanes[k] > *absmax) *absmax = lanes[k];
    *nan |= _mm256_movemask_ps(unordered) != 0;
    return i;
}

__attribute__((target("avx2,fma")))
static int int8_encode_avx2(const float *in, int n, float scale, const uint32_t *buckets, uint8_t zero,
                            uint8_t *codes, int gathers) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i low_byte = _mm256_set1_epi32(0xFF), held = _mm256_set1_epi32(0x100);
    const __m256i top = _mm256_set1_epi32(~0x7FFF), zero_code = _mm256_set1_epi32(zero);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 y = _mm256_div_ps(_mm256_loadu_ps(in + i), s);
        __m256i bits = _mm256_castps_si256(y);
        __m256i at = _mm256_srli_epi32(bits, 15), entry;
        if (gathers) {
            entry = _mm256_i32gather_epi32((const int *)buckets, at, 4);
        } else {
            uint32_t b[8];
            _mm256_storeu_si256((__m256i *)b, at);
            entry = _mm256_setr_epi32((int)buckets[b[0]], (int)buckets[b[1]], (int)buckets[b[2]], (int)buckets[b[3]],
                                      (int)buckets[b[4]], (int)buckets[b[5]], (int)buckets[b[6]], (int)buckets[b[7]]);
        }
        __m256i k = _mm256_and_si256(entry, low_byte);
        /* the bucket's midpoint: y's top 17 bits and the entry's 15 */
        __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, top), _mm256_srli_epi32(entry, 16)));
        __m256i below = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(m, y, _CMP_LT_OQ)),
                                         _mm256_cmpeq_epi32(_mm256_and_si256(entry, held), held));
        k = _mm256_sub_epi32(k, below); /* below is -1 where the midpoint lies below: one code up */
        k = _mm256_blendv_epi8(k, zero_code, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
        __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packus_epi16(words, words));
    }
    return i;
}

__attribute__((target("avx2,fma")))
static int bf16_decode_avx2(const uint16_t *b, int n, float *out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    return i;
}

/* bf16 of in[i], to nearest even (every NaN 0xFFFF), or with `stochastic` (finite values) 16 random bits added
 * below the bf16 part before truncating: the bits of element index + i, keyed by `key`. */
__attribute__((target("avx2,fma")))
static int bf16_encode_avx2(const float *in, int n, int stochastic, uint32_t key, uint32_t index, uint16_t *out) {
    const __m256i round = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0xFFFF);
    const __m256i exponent = _mm256_set1_epi32(0x7F800000), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k = _mm256_set1_epi32((int)key);
    const __m256i c1 = _mm256_set1_epi32((int)0x7FEB352Du), c2 = _mm256_set1_epi32((int)0x846CA68Bu);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 p = _mm256_loadu_ps(in + i);
        __m256i u = _mm256_castps_si256(p);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), nan, _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
        if (stochastic) {
            __m256i x = _mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32((int)(index + (uint32_t)i)), lanes), k);
            x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
            x = _mm256_mullo_epi32(x, c1);
            x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
            x = _mm256_mullo_epi32(x, c2);
            x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
            __m256i sr = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_srli_epi32(x, 16)), 16);
            __m256i finite = _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(u, exponent), exponent),
                                              _mm256_set1_epi32(-1));
            r = _mm256_blendv_epi8(r, sr, finite);
        }
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    return i;
}
#endif

static int use_avx2; /* the CPU runs AVX2: set once at import (compact_init) */
static int use_gathers; /* the int8 codecs read their tables with gathers: the faster way here (compact_init) */

/* bf16 of in[0, n) into out: to nearest even, or stochastically (see bf16_encode_avx2). */
static void bf16_encode(uint16_t *out, const float *in, int n, int stochastic, uint32_t key, uint32_t index) {
    int i = 0;
#ifdef HAVE_AVX2_CODECS
    if (use_avx2) i = bf16_encode_avx2(in, n, stochastic, key, index, out);
#endif
    for (; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, in + i, 4);
        if (stochastic && (bits & 0x7F800000u) != 0x7F800000u)
            out[i] = (uint16_t)((bits + (mix32((index + (uint32_t)i) ^ key) >> 16)) >> 16);
        else
            out[i] = bf16_bits(in[i]);
    }
}

/* A Kahan master's values in[0, n) into its bf16 weights and compensation, as state_format.py's Kahan.encode:
 * twice (the second time from the pair's own sum), the weight to nearest and the remainder to nearest. */
static void kahan_encode(uint16_t *weights, uint16_t *compensation, const float *in, int n) {
    for (int i = 0; i < n; i++) {
        float x = in[i];
        for (int pass = 0; pass < 2; pass++) {
            uint32_t w = (uint32_t)bf16_bits(x) << 16, c;
            float wf, cf;
            memcpy(&wf, &w, 4);
            c = (w & 0x7F800000u) == 0x7F800000u ? 0 : (uint32_t)bf16_bits(x - wf) << 16;
            memcpy(&cf, &c, 4);
            weights[i] = (uint16_t)(w >> 16);
            compensation[i] = (uint16_t)(c >> 16);
            x = wf + cf;
        }
    }
}

/* Elements [lo, lo + n) of a stored part into `out` (fp32 kind: a pointer into the segment, nothing copied). */
static float *decode(int kind, void *base, int64_t numel, int64_t lo, int n, float *out, const Maps *maps) {
    if (kind == STORE_FP32) return (float *)base + lo;
    int i = 0;
    if (kind == STORE_BF16) {
        const uint16_t *b = (const uint16_t *)base + lo;
#ifdef HAVE_AVX2_CODECS
        if (use_avx2) i = bf16_decode_avx2(b, n, out);
#endif
        for (; i < n; i++) {
            uint32_t u = (uint32_t)b[i] << 16;
            memcpy(out + i, &u, 4);
        }
        return out;
    }
    const float *map = maps->values[kind == STORE_INT8_UNSIGNED];
    float absmax = ((const float *)base)[lo / QBLOCK];
    const uint8_t *codes = (const uint8_t *)base + 4 * blocks_of(numel) + lo;
#ifdef HAVE_AVX2_CODECS
    if (use_avx2) i = int8_decode_avx2(codes, n, map, absmax, out, use_gathers);
#endif
    for (; i < n; i++) out[i] = map[codes[i]] * absmax;
    return out;
}

/* The nearest code of y: how many of the 255 midpoints lie below it (NaN: the code of 0). */
static inline uint8_t nearest(const uint32_t *buckets, float y, uint8_t zero) {
    uint32_t bits, entry, mid_bits;
    float mid;
    memcpy(&bits, &y, 4);
    entry = buckets[bits >> 15];
    mid_bits = (bits & ~0x7FFFu) | entry >> 16;
    memcpy(&mid, &mid_bits, 4);
    unsigned k = (entry & 0xFF) + ((entry & 0x100) && mid < y);
    return y != y ? zero : (uint8_t)k;
}

/* `in` (n elements from lo, a whole block or the segment's end) into a stored part, rounded to nearest. */
static void encode(int kind, void *base, int64_t numel, int64_t lo, int n, const float *in, const Maps *maps,
                   const uint8_t zeros[2]) {
    if (kind == STORE_FP32) return; /* stepped in place */
    if (kind == STORE_BF16) {
        bf16_encode((uint16_t *)base + lo, in, n, 0, 0, 0);
        return;
    }
    int u = kind == STORE_INT8_UNSIGNED, i = 0;
    float absmax = 0.0f;
    int nan = 0;
#ifdef HAVE_AVX2_CODECS
    if (use_avx2) i = absmax_avx2(in, n, &absmax, &nan);
#endif
    for (; i < n; i++) {
        float a = fabsf(in[i]);
        if (a != a) nan = 1;
        else if (a > absmax) absmax = a;
    }
    if (nan) absmax = NAN;
    uint8_t *codes = (uint8_t *)base + 4 * blocks_of(numel) + lo;
    if (absmax < TINY) { /* zero, or too small for every code times it to stay a normal float */
        ((float *)base)[lo / QBLOCK] = 0.0f;
        memset(codes, 0, (size_t)n);
        return;
    }
    ((float *)base)[lo / QBLOCK] = absmax;
    float scale = absmax > 0 ? absmax : 1.0f;
    const uint32_t *buckets = maps->buckets[u];
    i = 0;
#ifdef HAVE_AVX2_CODECS
    if (use_avx2) i = int8_encode_avx2(in, n, scale, buckets, zeros[u], codes, use_gathers);
#endif
    for (; i < n; i++) codes[i] = nearest(buckets, in[i] / scale, zeros[u]);
}


#ifdef HAVE_AVX2_CODECS
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whether the int8 decode runs faster with gathers than with scalar loads on this CPU: the best of 9 alternating
 * timings of each over 16K codes (~0.1 ms). Either way the bits are the same. */
static int gathers_are_faster(void) {
    enum { N = 1 << 14 };
    static float map[256], out[N];
    static uint8_t codes[N];
    for (int i = 0; i < 256; i++) map[i] = (float)i / 255.0f;
    for (uint32_t i = 0; i < N; i++) codes[i] = (uint8_t)(mix32(i) >> 24);
    double best[2] = {1e9, 1e9};
    for (int round = 0; round < 9; round++)
        for (int gathers = 0; gathers < 2; gathers++) {
            double start = now();
            int8_decode_avx2(codes, N, map, 1.0f, out, gathers);
            double took = now() - start;
            if (took < best[gathers]) best[gathers] = took;
        }
    return best[1] < best[0];
}
#endif

/* int8_lookup([how]): how the int8 codecs read their tables, "gathers" or "loads" (AVX2), "scalar" without AVX2;
 * given "gathers" or "loads", use that from now on (the tests run both; the bits are the same). */
PyObject *int8_lookup(PyObject *self, PyObject *args) {
    const char *how = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|s", &how)) return NULL;
    if (how) {
        if (!use_avx2 || (strcmp(how, "gathers") && strcmp(how, "loads")))
            return PyErr_Format(PyExc_ValueError, "int8_lookup(%R): 'gathers' or 'loads', on a CPU with AVX2 (%s)",
                                PyTuple_GET_ITEM(args, 0), use_avx2 ? "this one has" : "this one has not");
        use_gathers = !strcmp(how, "gathers");
    }
    return PyUnicode_FromString(!use_avx2 ? "scalar" : use_gathers ? "gathers" : "loads");
}

void compact_init(void) {
#ifdef HAVE_AVX2_CODECS
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (use_avx2) use_gathers = gathers_are_faster();
#endif
}

PyObject *compact_step(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"master", "master_kind", "grad", "exp_avg", "exp_avg_kind", "exp_avg_sq",
                               "exp_avg_sq_kind", "out", "out_kind", "numel", "stochastic", "key", "index",
                               "signed_values", "signed_buckets", "unsigned_values", "unsigned_buckets", "lo", "hi",
                               "step", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "grad_scale",
                               "compensation", NULL};
    unsigned long long p, g, m, v, o, sv, sb, uv, ub, c = 0;
    int p_kind, m_kind, v_kind, out_kind, stochastic, decoupled;
    unsigned long key;
    long long numel, index, lo, hi, step_count;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KiKKiKiKiLpkLKKKKLL$LdddddpdK", keywords, &p, &p_kind, &g,
                                     &m, &m_kind, &v, &v_kind, &o, &out_kind, &numel, &stochastic, &key, &index, &sv,
                                     &sb, &uv, &ub, &lo, &hi, &step_count, &lr, &beta1, &beta2, &eps, &weight_decay,
                                     &decoupled, &grad_scale, &c))
        return NULL;
    if (c && (p_kind != STORE_BF16 || stochastic))
        return PyErr_Format(PyExc_ValueError, "compact_step: a compensation is a bf16 master's rounded to nearest "
                            "(master kind 1, not stochastic)");
    if (p_kind < STORE_FP32 || p_kind > STORE_BF16 || m_kind < 0 || m_kind > 3 || v_kind < 0 || v_kind > 3
        || out_kind < OUT_NONE || out_kind > OUT_FP16 || (p_kind == STORE_BF16 && out_kind == OUT_FP16))
        return PyErr_Format(PyExc_ValueError, "compact_step: kinds master %d (0 fp32, 1 bf16), exp_avg %d, exp_avg_sq "
                            "%d (0 fp32, 1 bf16, 2 int8 signed, 3 int8 unsigned), out %d (0 none, 1 bf16, 2 fp16; "
                            "not fp16 from a bf16 master)", p_kind, m_kind, v_kind, out_kind);
    if (lo < 0 || lo % QBLOCK || hi < lo || hi > numel || step_count < 1 || !(grad_scale > 0))
        return PyErr_Format(PyExc_ValueError, "compact_step: [lo %lld, hi %lld) of %lld elements (lo a multiple of "
                            "%d), step %lld (>= 1), grad_scale > 0", lo, hi, numel, QBLOCK, step_count);
    if (hi > lo && (!p || !g || !m || !v || (out_kind != OUT_NONE && !o) || !sv || !sb || !uv || !ub))
        return PyErr_Format(PyExc_ValueError, "compact_step: a null address");
    Maps maps = {{(const float *)(uintptr_t)sv, (const float *)(uintptr_t)uv},
                 {(const uint32_t *)(uintptr_t)sb, (const uint32_t *)(uintptr_t)ub}};
    Step base = derive_step(step_count, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
    base.out = OUT_NONE;
    VectorSpan vector_span = adam_best_span();
    void *pv = (void *)(uintptr_t)p, *mv = (void *)(uintptr_t)m, *vv = (void *)(uintptr_t)v;
    float *grad = (float *)(uintptr_t)g;
    uint16_t *out = (uint16_t *)(uintptr_t)o, *compensation = (uint16_t *)(uintptr_t)c;
    int64_t body_end = numel - numel % 8; /* torch's vector loop's end: its scalar tail rounds v its own way */
    Py_BEGIN_ALLOW_THREADS
    uint8_t zeros[2];
    for (int u = 0; u < 2; u++) { /* the index of code 0.0 in each map */
        zeros[u] = 0;
        while (maps.values[u][zeros[u]] != 0.0f) zeros[u]++;
    }
    float tp[QBLOCK], tm[QBLOCK], tv[QBLOCK];
    for (int64_t b = lo; b < hi; b += QBLOCK) {
        int n = (int)(hi - b < QBLOCK ? hi - b : QBLOCK);
        Step s = base;
        s.p = decode(p_kind, pv, numel, b, n, tp, &maps);
        if (compensation)
            for (int i = 0; i < n; i++) {
                uint32_t u = (uint32_t)compensation[b + i] << 16;
                float r;
                memcpy(&r, &u, 4);
                tp[i] += r;
            }
        s.m = decode(m_kind, mv, numel, b, n, tm, &maps);
        s.v = decode(v_kind, vv, numel, b, n, tv, &maps);
        s.g = grad + b;
        int64_t vec = body_end - b < n ? (body_end - b > 0 ? body_end - b : 0) : n;
        int64_t done = vector_span ? vector_span(&s, vec) : 0;
        scalar_span(&s, done, vec, 0);
        scalar_span(&s, vec, n, 1);
        encode(m_kind, mv, numel, b, n, s.m, &maps, zeros);
        encode(v_kind, vv, numel, b, n, s.v, &maps, zeros);
        if (p_kind == STORE_BF16) {
            uint16_t *stored = (uint16_t *)pv + b;
            if (compensation)
                kahan_encode(stored, compensation + b, s.p, n);
            else
                bf16_encode(stored, s.p, n, stochastic, (uint32_t)key, (uint32_t)(index + b));
            if (out_kind == OUT_BF16) memcpy(out + b, stored, (size_t)n * 2);
        } else if (out_kind == OUT_BF16) {
            for (int i = 0; i < n; i++) out[b + i] = bf16_bits(s.p[i]);
        } else if (out_kind == OUT_FP16) {
            for (int i = 0; i < n; i++) out[b + i] = fp16_bits(s.p[i]);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
