/* The compact formats' codec loops (compact_kernel.c), vectorized: the same operations as its scalar loops, so the
 * same bits. Each returns how many elements it did (a multiple of its width), the caller finishing the rest. AVX2
 * where the CPU has it; for int8, AVX-512 with VBMI (Intel Ice Lake and later, AMD Zen 4 and later) where it has that.
 * Block-wise int8 is state_format.py's: a code's value is map[code] * absmax; encoding multiplies by 1 / absmax and
 * picks the nearest code with one read of the map's bucket table (compact_kernel.c, Maps). */
#ifndef ZERO_COMPACT_CODECS_H
#define ZERO_COMPACT_CODECS_H
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <stdint.h>
#define HAVE_AVX2_CODECS 1

/* AVX2: the int8 and bf16 codecs' loops 8 elements at a time. The int8 ones read their tables with `gathers` (one
 * instruction for 8 reads) or with 8 scalar loads: gathers are microcoded and the slower on some CPUs (AMD Zen 1:
 * scalar loads made the int8 step 1.7x faster), so compact_init times both on the encode. */
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
static int int8_encode_avx2(const float *in, int n, float inverse, const uint32_t *buckets, uint8_t zero,
                            uint8_t *codes, int gathers) {
    const __m256 s = _mm256_set1_ps(inverse);
    const __m256i low_byte = _mm256_set1_epi32(0xFF), held = _mm256_set1_epi32(0x100);
    const __m256i top = _mm256_set1_epi32(~0x7FFF), zero_code = _mm256_set1_epi32(zero);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 y = _mm256_mul_ps(_mm256_loadu_ps(in + i), s);
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

/* AVX-512 with VBMI: the int8 codecs 16 elements at a time, 64 for decode. */

/* Where each of a block's 64 codes goes so that int8_decode_vbmi's interleave, which works within 128-bit lanes,
 * writes the floats in order: the code at order[16 * lane + 4 * r + j] is element 16 * r + 4 * lane + j. */
static const uint8_t VBMI_ORDER[64] = {
    0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53,
    54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46,
    47, 60, 61, 62, 63};

/* The int8 decode without table reads: each byte of a code's fp32 value looked up in that byte's plane of the map
 * (`planes`: state_format.py's, 4 x 256 bytes, in 16 registers) by two two-register byte permutes (codes below 128
 * and from 128) and a blend on the code's top bit; the four bytes then interleaved into floats. About 3x the rate
 * of 8-wide table reads on AMD Zen 4. */
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static int int8_decode_vbmi(const uint8_t *codes, int n, const uint8_t *planes, float absmax, float *out) {
    if (n < 64) return 0;
    const __m512i order = _mm512_loadu_si512(VBMI_ORDER);
    const __m512 a = _mm512_set1_ps(absmax);
    __m512i table[4][4];
    for (int b = 0; b < 4; b++)
        for (int q = 0; q < 4; q++) table[b][q] = _mm512_loadu_si512(planes + 256 * b + 64 * q);
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
        __mmask64 high = _mm512_movepi8_mask(c);
        __m512i byte[4];
        for (int b = 0; b < 4; b++)
            byte[b] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(table[b][0], c, table[b][1]),
                                             _mm512_permutex2var_epi8(table[b][2], c, table[b][3]));
        __m512i low01 = _mm512_unpacklo_epi8(byte[0], byte[1]), high01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
        __m512i low23 = _mm512_unpacklo_epi8(byte[2], byte[3]), high23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
        __m512i words[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                            _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
        for (int k = 0; k < 4; k++) _mm512_storeu_ps(out + i + 16 * k, _mm512_mul_ps(_mm512_castsi512_ps(words[k]), a));
    }
    return i;
}

/* As absmax_avx2, 16 at a time. */
__attribute__((target("avx512f,avx512bw")))
static int absmax_avx512(const float *in, int n, float *absmax, int *nan) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_abs_ps(_mm512_loadu_ps(in + i));
        unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        top = _mm512_max_ps(x, top); /* a NaN x gives top back */
    }
    float most = _mm512_reduce_max_ps(top);
    if (most > *absmax) *absmax = most;
    *nan |= unordered != 0;
    return i;
}

/* As int8_encode_avx2, 16 at a time. */
__attribute__((target("avx512f,avx512bw")))
static int int8_encode_avx512(const float *in, int n, float inverse, const uint32_t *buckets, uint8_t zero,
                              uint8_t *codes, int gathers) {
    const __m512 s = _mm512_set1_ps(inverse);
    const __m512i low_byte = _mm512_set1_epi32(0xFF), held = _mm512_set1_epi32(0x100), one = _mm512_set1_epi32(1);
    const __m512i top = _mm512_set1_epi32(~0x7FFF), zero_code = _mm512_set1_epi32(zero);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(in + i), s);
        __m512i bits = _mm512_castps_si512(y);
        __m512i at = _mm512_srli_epi32(bits, 15), entry;
        if (gathers) {
            entry = _mm512_i32gather_epi32(at, (const void *)buckets, 4);
        } else {
            uint32_t b[16];
            _mm512_storeu_si512(b, at);
            entry = _mm512_setr_epi32((int)buckets[b[0]], (int)buckets[b[1]], (int)buckets[b[2]], (int)buckets[b[3]],
                                      (int)buckets[b[4]], (int)buckets[b[5]], (int)buckets[b[6]], (int)buckets[b[7]],
                                      (int)buckets[b[8]], (int)buckets[b[9]], (int)buckets[b[10]],
                                      (int)buckets[b[11]], (int)buckets[b[12]], (int)buckets[b[13]],
                                      (int)buckets[b[14]], (int)buckets[b[15]]);
        }
        __m512i k = _mm512_and_si512(entry, low_byte);
        __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, top), _mm512_srli_epi32(entry, 16)));
        __mmask16 up = _mm512_cmp_ps_mask(m, y, _CMP_LT_OQ) & _mm512_test_epi32_mask(entry, held);
        k = _mm512_mask_add_epi32(k, up, k, one);
        k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), zero_code);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(k));
    }
    return i;
}
#endif
#endif
