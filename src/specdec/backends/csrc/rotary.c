/* Rotary position embedding of a pass's queries and keys, read from their stacked q/k/v GEMM's
   output (specdec, Apache-2.0).

   out[h][t][i] = bf16(bf16(x[i] * cos[t][i]) + bf16(r[i] * sin[t][i])) for head h of row t, with
   r = rotate_half(x) = (-x[half:], x[:half]): transformers' apply_rotary_pos_emb as eager torch
   rounds it in bf16 (each product, then their sum, to nearest even). Each element on its own, so
   a row's result never depends on what shares its pass. */

#include <stdint.h>
#include <string.h>

static inline float bf16_float(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* fp32 -> bf16, to nearest even as torch rounds (a NaN to its canonical quiet NaN) */
static inline uint16_t float_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float rounded(float f) { return bf16_float(float_bf16(f)); }

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512 widen(const uint16_t *at) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
}

/* 16 values to bf16 and back, to nearest even (the instruction quiets a NaN without canonical bits) */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
/* -v with the sign bit flipped, as torch's neg (0 - v would make -0 of +0 but +0 of -0) */
static inline __m512 negate(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}
#endif

/* One head of one row: src [dim] -> dst [dim], cos and sin [dim] */
static void rotate(const uint16_t *src, const uint16_t *cos, const uint16_t *sin, int64_t dim, uint16_t *dst) {
    const int64_t half = dim / 2;
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= half; i += 16) {
        const __m512 a = widen(src + i), b = widen(src + half + i);
        const __m512 low = _mm512_add_ps(round16(_mm512_mul_ps(a, widen(cos + i))),
                                         round16(_mm512_mul_ps(negate(b), widen(sin + i))));
        const __m512 high = _mm512_add_ps(round16(_mm512_mul_ps(b, widen(cos + half + i))),
                                          round16(_mm512_mul_ps(a, widen(sin + half + i))));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(low));
        _mm256_storeu_si256((__m256i *)(dst + half + i), (__m256i)_mm512_cvtneps_pbh(high));
    }
#endif
    for (; i < half; i++) {
        const float a = bf16_float(src[i]), b = bf16_float(src[half + i]);
        dst[i] = float_bf16(rounded(a * bf16_float(cos[i])) + rounded(-b * bf16_float(sin[i])));
        dst[half + i] = float_bf16(rounded(b * bf16_float(cos[half + i])) + rounded(a * bf16_float(sin[half + i])));
    }
}

/* heads heads of dim values per row, head h of row t at x + t * x_row + h * dim -> out [heads][rows][dim];
   cos, sin [rows][dim] (cs_row elements between rows). dim even. */
void specdec_rotary_bf16(int64_t rows, int64_t heads, int64_t dim, const uint16_t *x, int64_t x_row,
                         const uint16_t *cos, const uint16_t *sin, int64_t cs_row, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * heads >= 256)
    for (int64_t job = 0; job < rows * heads; job++) {
        const int64_t t = job / heads, h = job % heads;
        rotate(x + t * x_row + h * dim, cos + t * cs_row, sin + t * cs_row, dim, out + (h * rows + t) * dim);
    }
}
