/* The Adam step of a sub-group stored in a compact state format (zero/optim/state_format.py), one pass: for each
 * block of 256 elements, decode the master and moments into one block's buffers on the stack, run the exact
 * kernel's Adam arithmetic (adam_spans.h: torch's fused kernel bit for bit, its scalar tail for each parameter's
 * last numel % 8 elements: `tails`, as the exact kernel's), encode them back and write the compute-dtype copy.
 * zero/optim/compact_step.py's torch version computes the same bits; the tests compare the two.
 *
 * Storage kinds: 0 fp32 (stepped in place), 1 bf16 (rounded to nearest even; a master with `stochastic`:
 * 16 random bits added below its bf16 part, then truncated), 2 and 3 block-wise int8, signed and unsigned: the
 * segment holds one fp32 absmax per 256-element block, then one code per element; a value is map[code] * absmax,
 * and encoding picks the nearest code (the count of midpoints below value * (1 / absmax): one read of the map's
 * bucket table and one comparison, see Maps; the vector loops are compact_codecs.h's). A block whose absmax is
 * below 2^-100 is stored as zeros (absmax 0, codes 0). A bf16 master with a `compensation` (bf16-kahan,
 * state_format.py's Kahan) is its weights plus the compensation, summed in fp32; encoded, the weights and the
 * remainder round to nearest, twice (see kahan_encode). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <time.h>

#include "adam_spans.h"
#include "compact_codecs.h"

enum { STORE_FP32 = 0, STORE_BF16 = 1, STORE_INT8_SIGNED = 2, STORE_INT8_UNSIGNED = 3 };
#define QBLOCK 256
#define TINY 0x1p-100f

typedef struct {
    /* [0] signed, [1] unsigned: 256 values, and for each of the 2^17 buckets of floats sharing their top 17 bits
     * (sign, exponent, 8 bits of mantissa) one entry (state_format.py's buckets): bits 0-7 how many midpoints lie
     * below the bucket, bit 8 whether the bucket holds the next one, bits 16-30 its low 15 bits. No bucket holds
     * two midpoints, so comparing with that one finishes the count. */
    const float *values[2];
    const uint8_t *planes[2]; /* the values' bytes, byte b of value k at [256 * b + k] (int8_decode_vbmi) */
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

static int has_avx2, has_vbmi; /* the CPU runs AVX2, and AVX-512 with VBMI: set once at import (compact_init) */
enum { INT8_SCALAR, INT8_AVX2, INT8_AVX512 };
static int int8_simd;   /* the int8 codecs' loops: the widest the CPU runs (compact_init, int8_path) */
static int use_gathers; /* their table reads use gathers: the faster way here (compact_init, int8_path) */

/* bf16 of in[0, n) into out: to nearest even, or stochastically (see bf16_encode_avx2). */
static void bf16_encode(uint16_t *out, const float *in, int n, int stochastic, uint32_t key, uint32_t index) {
    int i = 0;
#ifdef HAVE_AVX2_CODECS
    if (has_avx2) i = bf16_encode_avx2(in, n, stochastic, key, index, out);
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
        if (has_avx2) i = bf16_decode_avx2(b, n, out);
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
    if (int8_simd == INT8_AVX512)
        i = int8_decode_vbmi(codes, n, maps->planes[kind == STORE_INT8_UNSIGNED], absmax, out);
    else if (int8_simd == INT8_AVX2) i = int8_decode_avx2(codes, n, map, absmax, out, use_gathers);
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
    if (int8_simd == INT8_AVX512) i = absmax_avx512(in, n, &absmax, &nan);
    else if (int8_simd == INT8_AVX2) i = absmax_avx2(in, n, &absmax, &nan);
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
    float inverse = 1.0f / (absmax > 0 ? absmax : 1.0f);
    const uint32_t *buckets = maps->buckets[u];
    i = 0;
#ifdef HAVE_AVX2_CODECS
    if (int8_simd == INT8_AVX512) i = int8_encode_avx512(in, n, inverse, buckets, zeros[u], codes, use_gathers);
    else if (int8_simd == INT8_AVX2) i = int8_encode_avx2(in, n, inverse, buckets, zeros[u], codes, use_gathers);
#endif
    for (; i < n; i++) codes[i] = nearest(buckets, in[i] * inverse, zeros[u]);
}


#ifdef HAVE_AVX2_CODECS
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whether the int8 encode (AVX-512 or AVX2) runs faster with gathers than with scalar loads on this CPU: the best of
 * 9 alternating timings of each over 16K values (~0.1 ms), a zeroed table standing in for a map's. Either way the
 * bits are the same. */
static int gathers_are_faster(int avx512) {
    enum { N = 1 << 14 };
    static uint32_t buckets[1 << 17];
    static float in[N];
    static uint8_t codes[N];
    for (uint32_t i = 0; i < N; i++) { /* spread over [-1, 1] and many exponents, as moments are */
        float x = (float)mix32(i) / 4294967296.0f * 2.0f - 1.0f;
        in[i] = x * x * x;
    }
    double best[2] = {1e9, 1e9};
    for (int round = 0; round < 9; round++)
        for (int gathers = 0; gathers < 2; gathers++) {
            double start = now();
            if (avx512) int8_encode_avx512(in, N, 1.0f, buckets, 0, codes, gathers);
            else int8_encode_avx2(in, N, 1.0f, buckets, 0, codes, gathers);
            double took = now() - start;
            if (took < best[gathers]) best[gathers] = took;
        }
    return best[1] < best[0];
}
#endif

/* The ways this CPU can run the int8 codecs, by name: "avx512-gathers" and "avx512-loads" (AVX-512 with VBMI; the
 * encode's table read with gathers or scalar loads), "avx2-gathers" and "avx2-loads" (AVX2; both codecs' reads),
 * "scalar" (always). */
static const char *PATHS[] = {"avx512-gathers", "avx512-loads", "avx2-gathers", "avx2-loads", "scalar"};
static int path_runs_here(int k) { return k == 4 || (k >= 2 ? has_avx2 : has_vbmi); }

/* int8_paths() -> the names of the paths this CPU runs. */
PyObject *int8_paths(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *names = PyList_New(0);
    for (int k = 0; names && k < 5; k++) {
        PyObject *name = path_runs_here(k) ? PyUnicode_FromString(PATHS[k]) : NULL;
        if (name && PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

/* int8_path([name]): the path the int8 codecs run (chosen at import: the widest, with the faster table read); given
 * one of int8_paths(), run that from now on (the tests run each; the bits are the same). */
PyObject *int8_path(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|s", &name)) return NULL;
    if (name) {
        int k = 0;
        while (k < 5 && strcmp(name, PATHS[k])) k++;
        if (k == 5 || !path_runs_here(k))
            return PyErr_Format(PyExc_ValueError, "int8_path(%R): not a path this CPU runs (see int8_paths())",
                                PyTuple_GET_ITEM(args, 0));
        int8_simd = k < 2 ? INT8_AVX512 : k < 4 ? INT8_AVX2 : INT8_SCALAR;
        use_gathers = k == 0 || k == 2;
    }
    return PyUnicode_FromString(PATHS[int8_simd == INT8_SCALAR ? 4 : 2 * (int8_simd == INT8_AVX2) + !use_gathers]);
}

void compact_init(void) {
#ifdef HAVE_AVX2_CODECS
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    has_vbmi = has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512vbmi");
    int8_simd = has_vbmi ? INT8_AVX512 : has_avx2 ? INT8_AVX2 : INT8_SCALAR;
    if (has_avx2) use_gathers = gathers_are_faster(has_vbmi);
#endif
}

Py_ssize_t parse_tails(PyObject *tails, int64_t numel, int64_t one[2], int64_t **spans); /* adam_kernel.c's */

PyObject *compact_step(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"master", "master_kind", "grad", "exp_avg", "exp_avg_kind", "exp_avg_sq",
                               "exp_avg_sq_kind", "out", "out_kind", "numel", "stochastic", "key", "index",
                               "signed_values", "signed_planes", "signed_buckets", "unsigned_values",
                               "unsigned_planes", "unsigned_buckets", "lo", "hi",
                               "step", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "grad_scale",
                               "compensation", "grad_kind", "tails", NULL};
    unsigned long long p, g, m, v, o, sv, sp, sb, uv, up, ub, c = 0;
    int p_kind, m_kind, v_kind, out_kind, stochastic, decoupled, g_kind = STORE_FP32;
    PyObject *tails = NULL;
    unsigned long key;
    long long numel, index, lo, hi, step_count;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KiKKiKiKiLpkLKKKKKKLL$LdddddpdKiO", keywords, &p, &p_kind,
                                     &g, &m, &m_kind, &v, &v_kind, &o, &out_kind, &numel, &stochastic, &key, &index,
                                     &sv, &sp, &sb, &uv, &up, &ub, &lo, &hi, &step_count, &lr, &beta1, &beta2, &eps,
                                     &weight_decay, &decoupled, &grad_scale, &c, &g_kind, &tails))
        return NULL;
    if (c && (p_kind != STORE_BF16 || stochastic))
        return PyErr_Format(PyExc_ValueError, "compact_step: a compensation is a bf16 master's rounded to nearest "
                            "(master kind 1, not stochastic)");
    if (p_kind < STORE_FP32 || p_kind > STORE_BF16 || m_kind < 0 || m_kind > 3 || v_kind < 0 || v_kind > 3
        || out_kind < OUT_NONE || out_kind > OUT_FP16 || (p_kind == STORE_BF16 && out_kind == OUT_FP16))
        return PyErr_Format(PyExc_ValueError, "compact_step: kinds master %d (0 fp32, 1 bf16), exp_avg %d, exp_avg_sq "
                            "%d (0 fp32, 1 bf16, 2 int8 signed, 3 int8 unsigned), out %d (0 none, 1 bf16, 2 fp16; "
                            "not fp16 from a bf16 master)", p_kind, m_kind, v_kind, out_kind);
    if (g_kind != STORE_FP32 && (g_kind != STORE_BF16 || grad_scale != 1.0))
        return PyErr_Format(PyExc_ValueError, "compact_step: grad_kind %d (0 fp32, 1 bf16: read as fp32, so "
                            "grad_scale must be 1: a scaled gradient is stored back in fp32)", g_kind);
    if (lo < 0 || lo % QBLOCK || hi < lo || hi > numel || step_count < 1 || !(grad_scale > 0))
        return PyErr_Format(PyExc_ValueError, "compact_step: [lo %lld, hi %lld) of %lld elements (lo a multiple of "
                            "%d), step %lld (>= 1), grad_scale > 0", lo, hi, numel, QBLOCK, step_count);
    if (hi > lo && (!p || !g || !m || !v || (out_kind != OUT_NONE && !o) || !sv || !sp || !sb || !uv || !up || !ub))
        return PyErr_Format(PyExc_ValueError, "compact_step: a null address");
    Maps maps = {{(const float *)(uintptr_t)sv, (const float *)(uintptr_t)uv},
                 {(const uint8_t *)(uintptr_t)sp, (const uint8_t *)(uintptr_t)up},
                 {(const uint32_t *)(uintptr_t)sb, (const uint32_t *)(uintptr_t)ub}};
    Step base = derive_step(step_count, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
    base.out = OUT_NONE;
    VectorSpan vector_span = adam_best_span();
    void *pv = (void *)(uintptr_t)p, *mv = (void *)(uintptr_t)m, *vv = (void *)(uintptr_t)v;
    float *grad = (float *)(uintptr_t)g;
    const uint16_t *grad16 = (const uint16_t *)(uintptr_t)g;
    uint16_t *out = (uint16_t *)(uintptr_t)o, *compensation = (uint16_t *)(uintptr_t)c;
    int64_t one[2], *spans, first = 0; /* the elements torch's scalar tail rounds (adam_kernel.c's `step`) */
    Py_ssize_t tail_count = parse_tails(tails, numel, one, &spans);
    if (tail_count < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    uint8_t zeros[2];
    for (int u = 0; u < 2; u++) { /* the index of code 0.0 in each map */
        zeros[u] = 0;
        while (maps.values[u][zeros[u]] != 0.0f) zeros[u]++;
    }
    float tp[QBLOCK], tm[QBLOCK], tv[QBLOCK], tg[QBLOCK];
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
        s.g = g_kind == STORE_BF16 ? decode(STORE_BF16, (void *)grad16, numel, b, n, tg, &maps) : grad + b;
        while (first < tail_count && spans[2 * first + 1] <= b) first++;
        step_range(&s, 0, n, spans + 2 * first, tail_count - first, b, vector_span);
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
            bf16_encode(out + b, s.p, n, 0, 0, 0);
        } else if (out_kind == OUT_FP16) {
            for (int i = 0; i < n; i++) out[b + i] = fp16_bits(s.p[i]);
        }
    }
    Py_END_ALLOW_THREADS
    if (spans != one) PyMem_Free(spans);
    Py_RETURN_NONE;
}
