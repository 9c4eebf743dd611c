/* zero.optim._adam_kernel: one Adam or AdamW step over flat fp32 arrays in a single pass, writing the bf16 or
 * fp16 copy of each updated param while it is still in a register.
 *
 * Why C: a step is bound by memory traffic. torch's fused kernel and a copy after it pass over the params
 * twice; this passes once and streams the copy-out past the cache. Plain C with Python.h only, so pip's
 * isolated build needs no torch headers. `step` releases the GIL and runs over [0, numel) on its caller's
 * thread, or with `threads` > 1 on the OpenMP thread team torch itself uses (libgomp's GOMP_parallel, found
 * at run time among the loaded libraries, not linked): right after a torch op its workers are still
 * spinning and take their part at once, where threads of our own would share cores with them.
 *
 * Arithmetic is torch's CPU fused kernel's, bit for bit (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * float `adam_math`, as compiled in torch's x86 wheels, which run the AVX2 build of that file on AVX2 and
 * AVX-512 machines alike): hyperparameters derived in double and rounded to float as torch does, the
 * same operations fused into FMAs as torch's compiler fused them (1 - lr * weight_decay included, in
 * double), and its scalar tail's own rounding for the last numel % 8 elements of each tensor it steps (see
 * `scalar_span`): a call over several parameters' flat buffer names those elements (`tails`). This
 * file compiles with -ffp-contract=off: every FMA here is written out. The Python side checks all of this
 * against torch on a probe before trusting it, and uses torch's kernel where it differs.
 *
 * One build runs anywhere: the AVX-512 and AVX2 loops are compiled for their ISA by function attributes
 * and picked at run time by CPUID; the scalar loop runs elsewhere and finishes the vector loops' tails. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#include "adam_spans.h"

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


/* The loops this CPU runs, best first: what `paths` reports and `step(path=...)` accepts. */
static const char *path_names[3];
static VectorSpan path_spans[3];
static int path_count;

VectorSpan adam_best_span(void) { return path_spans[0]; }

/* compact_kernel.c: the step of a sub-group stored in a compact state format. */
PyObject *compact_step(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *int8_paths(PyObject *self, PyObject *args);
PyObject *int8_path(PyObject *self, PyObject *args);
void compact_init(void);

/* `tails` (None: the call is one tensor, its tail its last numel % 8 elements) into `spans` (2 int64 a span,
 * `one` if it holds them, else allocated with PyMem_Malloc); the count of spans, or -1 with an exception set. */
Py_ssize_t parse_tails(PyObject *tails, int64_t numel, int64_t one[2], int64_t **spans) {
    *spans = one;
    if (tails == NULL || tails == Py_None) {
        one[0] = numel - numel % 8, one[1] = numel;
        return 1;
    }
    PyObject *seq = PySequence_Fast(tails, "step: tails must be a sequence of (start, stop) pairs");
    if (!seq) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > 0 && !(*spans = PyMem_Malloc(2 * count * sizeof(int64_t)))) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    int64_t last = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, k);
        long long start, stop;
        if (!PyTuple_Check(pair)) {
            PyErr_Format(PyExc_TypeError, "step: tail %zd is a %s, expected a (start, stop) tuple", k,
                         Py_TYPE(pair)->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(pair, "LL;step: a tail is a (start, stop) pair", &start, &stop)) goto fail;
        if (start < last || stop <= start || stop > numel) {
            PyErr_Format(PyExc_ValueError, "step: tail %zd is (%lld, %lld): expected sorted, disjoint, non-empty "
                         "spans of the %lld elements (the previous one stops at %lld)", k, start, stop,
                         (long long)numel, (long long)last);
            goto fail;
        }
        (*spans)[2 * k] = start, (*spans)[2 * k + 1] = last = stop;
    }
    Py_DECREF(seq);
    return count;
fail:
    Py_DECREF(seq);
    if (*spans != one) PyMem_Free(*spans);
    return -1;
}

/* libgomp's entry points, from the copy torch loaded (NULL where there is none: then one thread). */
typedef void (*GompParallel)(void (*)(void *), void *, unsigned, unsigned);
static GompParallel gomp_parallel;
static int (*omp_thread_num)(void), (*omp_num_threads)(void);

typedef struct {
    const Step *s;
    int64_t n;
    const int64_t *tails;
    int64_t tail_count;
    VectorSpan vector_span;
} Team;

/* One team member's share: a run starting at a multiple of 64 elements (so a streamed copy-out stays aligned),
 * the tails among them rounded as torch rounds them wherever the shares are cut. */
static void team_member(void *data) {
    const Team *t = data;
    int64_t k = omp_thread_num(), count = omp_num_threads();
    /* rounded up twice (to a count-th of the elements, then to 64): count shares cover all of them */
    int64_t share = ((t->n + count - 1) / count + 63) / 64 * 64, lo = k * share < t->n ? k * share : t->n;
    int64_t hi = lo + share < t->n ? lo + share : t->n;
    step_range(t->s, lo, hi, t->tails, t->tail_count, 0, t->vector_span);
}

static PyObject *step(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"param", "grad", "exp_avg", "exp_avg_sq", "out", "out_kind", "numel", "step", "lr",
                               "beta1", "beta2", "eps", "weight_decay", "decoupled", "grad_scale", "path", "threads",
                               "tails", NULL};
    unsigned long long p, g, m, v, o;
    int out_kind, decoupled;
    long long numel, step_count;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    const char *path = NULL;
    int threads = 1;
    PyObject *tails = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKKiLLdddddpd|ziO", keywords, &p, &g, &m, &v, &o, &out_kind,
                                     &numel, &step_count, &lr, &beta1, &beta2, &eps, &weight_decay, &decoupled,
                                     &grad_scale, &path, &threads, &tails))
        return NULL;
    if (threads < 1) return PyErr_Format(PyExc_ValueError, "step: threads %d, expected >= 1", threads);
    if (numel < 0 || step_count < 1 || out_kind < OUT_NONE || out_kind > OUT_FP16)
        return PyErr_Format(PyExc_ValueError, "step: numel %lld (expected >= 0), step %lld (>= 1), out_kind %d "
                            "(0 none, 1 bf16, 2 fp16)", numel, step_count, out_kind);
    if (!(grad_scale > 0)) {
        char message[64];
        snprintf(message, sizeof message, "step: grad_scale %g, expected > 0", grad_scale);
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    }
    if (numel > 0 && (!p || !g || !m || !v || (out_kind != OUT_NONE && !o)))
        return PyErr_Format(PyExc_ValueError, "step: a null address for %lld elements: param %llu, grad %llu, "
                            "exp_avg %llu, exp_avg_sq %llu, out %llu (out_kind %d)", numel, p, g, m, v, o, out_kind);
    VectorSpan vector_span = path_spans[0];
    if (path) {
        int k = 0;
        while (k < path_count && strcmp(path, path_names[k])) k++;
        if (k == path_count) return PyErr_Format(PyExc_ValueError, "step: path %s does not run on this CPU", path);
        vector_span = path_spans[k];
    }
    Step s = derive_step(step_count, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
    s.p = (float *)(uintptr_t)p, s.g = (float *)(uintptr_t)g, s.m = (float *)(uintptr_t)m;
    s.v = (float *)(uintptr_t)v, s.o = (uint16_t *)(uintptr_t)o, s.out = out_kind;
    int64_t one[2], *spans;
    Py_ssize_t tail_count = parse_tails(tails, numel, one, &spans);
    if (tail_count < 0) return NULL;
    Team team = {&s, numel, spans, tail_count, vector_span};
    Py_BEGIN_ALLOW_THREADS
    if (threads > 1 && gomp_parallel && numel >= 64 * threads) gomp_parallel(team_member, &team, (unsigned)threads, 0);
    else step_range(&s, 0, numel, spans, tail_count, 0, vector_span);
    Py_END_ALLOW_THREADS
    if (spans != one) PyMem_Free(spans);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"step", (PyCFunction)(void (*)(void))step, METH_VARARGS | METH_KEYWORDS,
     "step(param, grad, exp_avg, exp_avg_sq, out, out_kind, numel, step, lr, beta1, beta2, eps, weight_decay, "
     "decoupled, grad_scale, path=None, threads=1, tails=None)\n\n"
     "One Adam (decoupled=False) or AdamW step over numel fp32 elements at the given data addresses, as "
     "torch._fused_adam(w)_ does it; out_kind 1 (bf16) or 2 (fp16) writes the updated params to the address "
     "`out` as well (0: none). grad_scale != 1 divides grad by float(1 / grad_scale), stored back. Releases the GIL "
     "while it runs. path: one of `paths` (default the first). threads > 1: on that many OpenMP threads where "
     "`team` is 1 (torch's libgomp was found). tails: the (start, stop) spans, sorted and disjoint, that torch's "
     "scalar tail rounds (each parameter's last numel % 8 elements where the call steps several: torch steps each "
     "as its own tensor); None: the last numel % 8. The caller keeps the memory alive and valid."},
    {"compact_step", (PyCFunction)(void (*)(void))compact_step, METH_VARARGS | METH_KEYWORDS,
     "compact_step(master, master_kind, grad, exp_avg, exp_avg_kind, exp_avg_sq, exp_avg_sq_kind, out, out_kind, numel, "
     "stochastic, key, index, signed_values, signed_planes, signed_buckets, unsigned_values, unsigned_planes, "
     "unsigned_buckets, lo, hi, *, step, "
     "lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale, compensation=0, grad_kind=0)\n\n"
     "The step of elements [lo, hi) of a sub-group of numel elements stored in a compact format (see "
     "compact_kernel.c); lo a multiple of 256; compensation: a bf16-kahan master's (0: none); grad_kind 1: grad "
     "is bf16, read as fp32 (grad_scale 1). Releases the GIL "
     "while it runs. The caller keeps the memory alive."},
    {"int8_paths", int8_paths, METH_NOARGS,
     "int8_paths() -> the ways this CPU runs the int8 codecs: 'avx512-gathers', 'avx512-loads' (AVX-512 with VBMI), "
     "'avx2-gathers', 'avx2-loads', 'scalar'."},
    {"int8_path", int8_path, METH_VARARGS,
     "int8_path([name]) -> the way the int8 codecs run (at import: the widest, its table reads timed for the faster); "
     "name, one of int8_paths(), sets it. The bits are the same."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zero.optim._adam_kernel",
    .m_doc = "One CPU Adam/AdamW step with its bf16/fp16 copy-out, as torch's fused kernel computes it.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__adam_kernel(void) {
    compact_init();
#ifdef HAVE_X86_PATHS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        path_names[path_count] = "avx512";
        path_spans[path_count++] = avx512_span;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        path_names[path_count] = "avx2";
        path_spans[path_count++] = avx2_span;
    }
#endif
    path_names[path_count] = "scalar";
    path_spans[path_count++] = NULL;
    gomp_parallel = (GompParallel)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    *(void **)&omp_thread_num = dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    *(void **)&omp_num_threads = dlsym(RTLD_DEFAULT, "omp_get_num_threads");
    if (!omp_thread_num || !omp_num_threads) gomp_parallel = NULL;
    PyObject *mod = PyModule_Create(&module), *paths = PyTuple_New(path_count);
    if (!mod || !paths) goto fail;
    for (int k = 0; k < path_count; k++) {
        PyObject *name = PyUnicode_FromString(path_names[k]);
        if (!name) goto fail;
        PyTuple_SET_ITEM(paths, k, name);
    }
    if (PyModule_AddObject(mod, "paths", paths) < 0) goto fail;
    paths = NULL; /* the module owns it now */
    if (PyModule_AddIntConstant(mod, "team", gomp_parallel != NULL) < 0) goto fail;
    return mod;
fail:
    Py_XDECREF(paths);
    Py_XDECREF(mod);
    return NULL;
}
