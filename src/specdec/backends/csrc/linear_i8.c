/* int8 linear layers for a drafter's few-row passes (specdec, Apache-2.0).

   y[m, n] ~ sum_k x[m, k] W[n, k] (+ bias[n]) with W rounded once at load to int8, one scale per
   output (backends/kernels.py, `quantize_int8`), and stored offset by 128 as unsigned bytes in
   tiles of 16 outputs by 4 inputs ([n / 16][k / 4][16][4]: backends/native.py, `pack_i8`). Each
   call rounds its input rows to int8 too, one scale per row and group of `group` inputs (an
   outlier channel flattens only its own group), and the CPU's int8 dot-product instruction
   (AVX512-VNNI: unsigned by signed bytes, four products a lane) sums each group exactly in
   int32. A weight byte costs one instruction per row, so a few-row call streams the weights at
   the memory's speed: half of bf16's bytes.

   Only for drafters: rounding changes which tokens they propose, never what the target keeps.
   A row's result depends on its own inputs alone, whatever else the call holds. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define TILE 16   /* outputs per tile: one register's int32 lanes */
#define TILES 4   /* tiles a thread works on at once */
#define ROWS 4    /* rows whose sums stay in registers at once (2-8 rows by 2-4 tiles streamed alike) */

/* bytes of scratch space specdec_linear_i8 needs for `rows` rows of `k` inputs in groups of `group` */
int64_t specdec_linear_i8_scratch(int64_t rows, int64_t k, int64_t group) {
    return rows * (k + 2 * (group > 0 ? k / group : 0) * 4) + 64;
}

static inline __attribute__((unused)) float bf16_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row x [k] bf16 -> q [k] int8, and per group of `group` inputs its scale (max |x| / 127, q * scale
   ~ x) and 128 * sum(q), which the weights' offset of 128 adds to each group's int32 sum (AVX512-VNNI;
   AVX2 takes the offset off the weights instead). */
static __attribute__((unused)) void quantize_row(const uint16_t *x, int64_t k, int64_t group, int8_t *q, float *scales,
                                                 int32_t *offsets) {
    for (int64_t g = 0; g < k / group; g++) {
        const uint16_t *xg = x + g * group;
        float most = 0.0f;
        for (int64_t i = 0; i < group; i++) most = fmaxf(most, fabsf(bf16_float(xg[i])));
        const float inverse = most > 0.0f ? 127.0f / most : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < group; i++) {
            const float r = bf16_float(xg[i]) * inverse;  /* NaN where the group holds an inf or NaN */
            const int32_t v = r == r ? (int32_t)nearbyintf(fminf(fmaxf(r, -127.0f), 127.0f)) : 0;
            q[g * group + i] = (int8_t)v;
            sum += v;
        }
        scales[g] = most / 127.0f;
        offsets[g] = 128 * sum;
    }
}

/* Every row of x rounded into scratch (`specdec_linear_i8_scratch` bytes): scales [rows][groups],
   offsets [rows][groups], then q [rows][k]. */
static __attribute__((unused)) void quantize_rows(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t k,
                                                  int64_t group, void *scratch, float **scales, int32_t **offsets,
                                                  int8_t **q) {
    const int64_t groups = k / group;
    *scales = (float *)scratch;
    *offsets = (int32_t *)(*scales + rows * groups);
    *q = (int8_t *)(*offsets + rows * groups);
    for (int64_t m = 0; m < rows; m++)
        quantize_row(x + m * x_stride, k, group, *q + m * k, *scales + m * groups, *offsets + m * groups);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

int specdec_linear_i8_available(void) { return 1; }

/* Rows m0..m0+height-1 (height <= ROWS) by tiles first..first+count-1 (count <= TILES), over all of
   k: each group's int32 sums, less the offset, scaled by the row's group scale into fp32 sums, which
   the weights' scales and the bias finish. Inlined with height and count constants. */
static inline __attribute__((always_inline)) void block(const int8_t *q, const float *scales, const int32_t *offsets,
                                                        int64_t m0, const uint8_t *packed, const float *w_scales,
                                                        const uint16_t *bias, int64_t n, int64_t k, int64_t group,
                                                        int64_t first, uint16_t *y, int64_t y_stride,
                                                        const int64_t height, const int64_t count) {
    const int64_t quads = k / 4, groups = k / group, per_group = group / 4;
    __m512 sums[ROWS][TILES];
    for (int64_t m = 0; m < height; m++)
        for (int64_t t = 0; t < count; t++) sums[m][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[ROWS][TILES];
        for (int64_t m = 0; m < height; m++)
            for (int64_t t = 0; t < count; t++) acc[m][t] = _mm512_setzero_si512();
        for (int64_t p = g * per_group; p < (g + 1) * per_group; p++) {
            __m512i w[TILES];
            for (int64_t t = 0; t < count; t++) w[t] = _mm512_loadu_si512(packed + ((first + t) * quads + p) * 64);
            for (int64_t m = 0; m < height; m++) {
                int32_t four;
                memcpy(&four, q + (m0 + m) * k + 4 * p, sizeof four);
                const __m512i xs = _mm512_set1_epi32(four);
                for (int64_t t = 0; t < count; t++) acc[m][t] = _mm512_dpbusd_epi32(acc[m][t], w[t], xs);
            }
        }
        for (int64_t m = 0; m < height; m++) {
            const __m512i offset = _mm512_set1_epi32(offsets[(m0 + m) * groups + g]);
            const __m512 scale = _mm512_set1_ps(scales[(m0 + m) * groups + g]);
            for (int64_t t = 0; t < count; t++)
                sums[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][t], offset)), scale, sums[m][t]);
        }
    }
    for (int64_t t = 0; t < count; t++) {
        const int64_t column = (first + t) * TILE, width = n - column < TILE ? n - column : TILE;
        const __mmask16 mask = (__mmask16)((1u << width) - 1u);
        const __m512 w_scale = _mm512_maskz_loadu_ps(mask, w_scales + column);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + column)), 16));
        for (int64_t m = 0; m < height; m++)  /* rounded by integer ops: no AVX512-BF16 needed */
            store_bf16(y + (m0 + m) * y_stride + column, round_bf16((v16)_mm512_fmadd_ps(sums[m][t], w_scale, b)), width);
    }
}

#define BLOCK_ARGS const int8_t *q, const float *scales, const int32_t *offsets, int64_t m0, const uint8_t *packed, \
    const float *w_scales, const uint16_t *bias, int64_t n, int64_t k, int64_t group, int64_t first, uint16_t *y, \
    int64_t y_stride, int64_t height, int64_t count
#define BLOCK(H) static void block_##H(BLOCK_ARGS) { (void)height; (void)count; \
    block(q, scales, offsets, m0, packed, w_scales, bias, n, k, group, first, y, y_stride, H, TILES); }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4)
static void block_any(BLOCK_ARGS) {
    block(q, scales, offsets, m0, packed, w_scales, bias, n, k, group, first, y, y_stride, height, count);
}
typedef void (*block_fn)(BLOCK_ARGS);

/* y [rows, n] (y_stride elements between rows, bf16) ~ x [rows, k] (x_stride, bf16) @ W^T + bias
   (bf16 [n], or NULL), W packed by `pack_i8` with its scales w_scales [n] fp32; k a multiple of
   group, group a multiple of 4. scratch: specdec_linear_i8_scratch(rows, k, group) bytes, 4-byte aligned.
   Returns 0, or -1 for a group that does not fit k. */
int specdec_linear_i8(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *packed, const float *w_scales,
                      int64_t n, int64_t k, int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                      int threads, void *scratch) {
    if (group <= 0 || group % 4 || k % group) return -1;
    float *scales;
    int32_t *offsets;
    int8_t *q;
    quantize_rows(x, rows, x_stride, k, group, scratch, &scales, &offsets, &q);
    static const block_fn full[] = {block_any, block_1, block_2, block_3, block_4};
    const int64_t tiles = (n + TILE - 1) / TILE, blocks = (tiles + TILES - 1) / TILES;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * TILES, count = first + TILES <= tiles ? TILES : tiles - first;
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
            const int64_t height = m0 + ROWS < rows ? ROWS : rows - m0;
            block_fn fn = count == TILES ? full[height] : block_any;
            fn(q, scales, offsets, m0, packed, w_scales, bias, n, k, group, first, y, y_stride, height, count);
        }
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 2: AVX2, which has no int8 dot product of four: each byte of a weight quad takes the sign of
   the input byte it meets (the input as its magnitude, at most 127), pairs of products are summed
   in 16 bits (at most 2 * 127 * 127, no saturation) and pairs of those in 32: the group's sum
   exactly, as the dot-product instruction gives it, so rows come out with the AVX512-VNNI
   kernel's bits. The weights' offset of 128 comes off by flipping each byte's top bit. */
int specdec_linear_i8_available(void) { return 2; }

#define A_ROWS 4  /* rows whose int32 sums (two registers a tile) stay in registers at once */

/* Rows m0..m0+height-1 of tile `tile` over all of k (as the AVX512 kernel's `block`, one tile a
   time): each group's int32 sums scaled by the row's group scale into fp32 sums, which the weights'
   scales and the bias finish. Inlined with height a constant. */
static inline __attribute__((always_inline)) void tile_rows(const int8_t *q, const float *scales, int64_t m0,
                                                            const uint8_t *packed, const float *w_scales,
                                                            const uint16_t *bias, int64_t n, int64_t k, int64_t group,
                                                            int64_t tile, uint16_t *y, int64_t y_stride,
                                                            const int64_t height) {
    const int64_t quads = k / 4, groups = k / group, per_group = group / 4;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 sums[A_ROWS][2];
    _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) sums[m][0] = sums[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[A_ROWS][2];
        _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (int64_t p = g * per_group; p < (g + 1) * per_group; p++) {
            const uint8_t *at = packed + (tile * quads + p) * 64;  /* one cache line */
            _mm_prefetch((const char *)at + 1024, _MM_HINT_T0);  /* a thread's tiles are one stretch of memory */
            const __m256i w_lo = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)at), flip);
            const __m256i w_hi = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(at + 32)), flip);
            _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
                int32_t four;
                memcpy(&four, q + (m0 + m) * k + 4 * p, sizeof four);
                const __m256i xs = _mm256_set1_epi32(four), magnitude = _mm256_abs_epi8(xs);
                acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w_lo, xs)), ones));
                acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w_hi, xs)), ones));
            }
        }
        _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
            const __m256 scale = _mm256_set1_ps(scales[(m0 + m) * groups + g]);
            sums[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), scale, sums[m][0]);
            sums[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), scale, sums[m][1]);
        }
    }
    const int64_t column = tile * TILE, width = n - column < TILE ? n - column : TILE;
    float w_scale[TILE] = {0}, b[TILE] = {0};
    for (int64_t i = 0; i < width; i++) {
        w_scale[i] = w_scales[column + i];
        if (bias) b[i] = bf16_float(bias[column + i]);
    }
    for (int64_t m = 0; m < height; m++) {
        float out[TILE];
        _mm256_storeu_ps(out, _mm256_fmadd_ps(sums[m][0], _mm256_loadu_ps(w_scale), _mm256_loadu_ps(b)));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(sums[m][1], _mm256_loadu_ps(w_scale + 8), _mm256_loadu_ps(b + 8)));
        for (int64_t i = 0; i < width; i++) y[(m0 + m) * y_stride + column + i] = to_bf16(out[i]);
    }
}

#define TILE_ROWS_ARGS const int8_t *q, const float *scales, int64_t m0, const uint8_t *packed, const float *w_scales, \
    const uint16_t *bias, int64_t n, int64_t k, int64_t group, int64_t tile, uint16_t *y, int64_t y_stride
#define TILE_ROWS(H) static void tile_rows_##H(TILE_ROWS_ARGS) { \
    tile_rows(q, scales, m0, packed, w_scales, bias, n, k, group, tile, y, y_stride, H); }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4)
typedef void (*tile_rows_fn)(TILE_ROWS_ARGS);

int specdec_linear_i8(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *packed, const float *w_scales,
                      int64_t n, int64_t k, int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                      int threads, void *scratch) {
    if (group <= 0 || group % 4 || k % group) return -1;
    float *scales;
    int32_t *offsets;
    int8_t *q;
    quantize_rows(x, rows, x_stride, k, group, scratch, &scales, &offsets, &q);
    static const tile_rows_fn by_height[] = {NULL, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4};
    const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m0 = 0; m0 < rows; m0 += A_ROWS) {
            const int64_t height = m0 + A_ROWS < rows ? A_ROWS : rows - m0;
            by_height[height](q, scales, m0, packed, w_scales, bias, n, k, group, t, y, y_stride);
        }
    return 0;
}

#else

int specdec_linear_i8_available(void) { return 0; }

int specdec_linear_i8(const uint16_t *x, int64_t rows, int64_t x_stride, const uint8_t *packed, const float *w_scales,
                      int64_t n, int64_t k, int64_t group, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                      int threads, void *scratch) {
    (void)x; (void)rows; (void)x_stride; (void)packed; (void)w_scales; (void)n; (void)k; (void)group; (void)bias;
    (void)y; (void)y_stride; (void)threads; (void)scratch;
    return -1;
}

#endif
