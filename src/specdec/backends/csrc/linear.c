/* bf16 linear layers for the few rows of a decode step or a verification pass (specdec, Apache-2.0).

   y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]), W packed once at load in tiles of 16 outputs by 2
   inputs ([n / 16][k / 2][16][2]: backends/native.py, `pack_tiles`), read by the CPU's bf16
   dot-product instruction (AVX512-BF16; without it, on AVX512 or AVX2, each pair widened to fp32
   and summed by fused multiply-adds): one pass over the weights streams them at the memory's
   speed, every row of the call reusing each tile while it is in cache.

   Every output's sum runs over k in one order, in one lane, whatever the number of rows, the
   blocking or the threads: a row comes out with the same bits in a call of 1 row or of 64
   (backends/rows.py needs no padding or cutting of the calls that use it). */

#include <stdint.h>
#include <string.h>

#define TILE 16      /* outputs per tile: one register's fp32 lanes */
#define GROUP 4      /* tiles a thread works on at once */
#define ROWS 6       /* rows whose sums stay in registers at once */
/* 7 or 8 rows: one block of 8 rows by 3 tiles (24 sums), not 6 rows and a block of 1-2 that reads
   the weights from L2 again (0.96x the 1.5B target's GEMMs at 7 and 8 rows, EPYC-BF16) */
#define GROUP8 3
#define ROWS8 8
/* input pairs per block: a group's block of weights (256 KiB) stays in L2, and its rows' sums are
   stored and reloaded less often than at 256 pairs (1.06x the 1.5B target's GEMMs at 8 and 32
   rows, 1.03x at 128, the same at 1-4, EPYC-BF16) */
#define PAIRS 1024

/* the floats of scratch space specdec_linear_bf16 needs for `rows` rows of `k` inputs and `n` outputs
   on `threads` threads: the rows widened to fp32 where the CPU has no bf16 dot product, and the
   sums (AVX512: each thread's in registers' blocks; AVX2: the whole call's, [rows][n in tiles]) */
int64_t specdec_linear_scratch(int64_t rows, int64_t k, int64_t n, int threads) {
    rows = rows > 0 ? rows : 1;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
    (void)k; (void)n;
    return rows * GROUP * TILE * threads;
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    (void)n;
    return rows * GROUP * TILE * threads + rows * k;
#else
    (void)threads;
    return rows * k + rows * ((n + TILE - 1) / TILE * TILE);
#endif
}

/* rows [rows, k] bf16 (x_stride apart) -> out [rows, k] fp32, exactly: the kernels without a bf16
   dot product read their inputs widened */
static __attribute__((unused)) void widen(const uint16_t *x, int64_t rows, int64_t x_stride, int64_t k, float *out) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < k; i++) {
            const uint32_t bits = (uint32_t)x[m * x_stride + i] << 16;
            memcpy(out + m * k + i, &bits, sizeof bits);
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512BF16__
/* 1: the dot-product instruction */
int specdec_linear_available(void) { return 1; }

/* the kernel's inputs: bf16 rows as given */
typedef uint16_t x_t;
typedef __m512i xs_t;  /* an input pair, broadcast */
typedef __m512i ws_t;  /* a tile's 16 weight pairs */
static inline xs_t pair_x(const x_t *at) {
    int32_t pair;
    memcpy(&pair, at, sizeof pair);
    return _mm512_set1_epi32(pair);
}
static inline ws_t pair_w(const uint16_t *at) { return _mm512_loadu_si512(at); }

/* acc + x's pair . w's pair, lane by lane */
static inline __m512 dot_pair(__m512 acc, xs_t xs, ws_t w) { return _mm512_dpbf16_ps(acc, (__m512bh)xs, (__m512bh)w); }

/* 16 sums rounded to bf16, nearest even */
static inline __m256i round_bf16(__m512 sums) { return (__m256i)_mm512_cvtneps_pbh(sums); }
#else
/* 2: the pairs widened to fp32 (exact) and summed by fused multiply-adds, the even input first */
int specdec_linear_available(void) { return 2; }

/* the kernel's inputs: the rows widened to fp32 once a call (`widen`), read a value at a time */
typedef float x_t;
typedef struct { __m512 even, odd; } xs_t;
typedef struct { __m512 even, odd; } ws_t;
static inline xs_t pair_x(const x_t *at) { return (xs_t){_mm512_set1_ps(at[0]), _mm512_set1_ps(at[1])}; }
/* a tile's pairs as two fp32 vectors: the even inputs shifted up, the odd ones with the low word
   zeroed by a masked move (its mask in a mask register, leaving the vector registers to the sums) */
static inline ws_t pair_w(const uint16_t *at) {
    const __m512i w = _mm512_loadu_si512(at);
    return (ws_t){_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_castsi512_ps(_mm512_maskz_mov_epi16(0xaaaaaaaau, w))};
}

static inline __m512 dot_pair(__m512 acc, xs_t xs, ws_t w) {
    return _mm512_fmadd_ps(xs.odd, w.odd, _mm512_fmadd_ps(xs.even, w.even, acc));
}

/* 16 sums rounded to bf16, nearest even (a NaN stays a NaN), as vec16.h's to_bf16 */
static inline __m256i round_bf16(__m512 sums) {
    const __m512i u = _mm512_castps_si512(sums);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(sums, sums, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* Where the block after this one lies, to be fetched into L2 while this one is computed: as many
   tiles as this block's (pairs * TILE * 2 values apart), of `pairs` input pairs from `at`; NULL:
   nothing. */
typedef struct { const uint16_t *at; int64_t pairs; } ahead_t;

/* Rows m0..m0+height-1 of tiles first..first+count-1 over input pairs start..end-1, the partial
   sums carried in `sums` [rows][GROUP][16] between blocks, fetching `ahead` into L2 on the way.
   Inlined with height and count constants (`group` picks a `block_H`), the sums stay in registers. */
static inline __attribute__((always_inline)) void block(const x_t *x, int64_t x_stride, const uint16_t *packed,
                                                        int64_t pairs, int64_t first, int64_t start, int64_t end,
                                                        int64_t m0, float *sums, ahead_t ahead,
                                                        const int64_t height, const int64_t count) {
    __m512 acc[ROWS8][GROUP];
    for (int64_t m = 0; m < height; m++)
        for (int64_t g = 0; g < count; g++)
            acc[m][g] = start ? _mm512_loadu_ps(sums + ((m0 + m) * GROUP + g) * TILE) : _mm512_setzero_ps();
    for (int64_t p = start; p < end; p++) {
        ws_t w[GROUP];
        for (int64_t g = 0; g < count; g++) w[g] = pair_w(packed + (((first + g) * pairs + p) * TILE) * 2);
        if (ahead.at && p - start < ahead.pairs)  /* a cache line of each of its tiles a step */
            for (int64_t g = 0; g < count; g++)
                _mm_prefetch((const char *)(ahead.at + ((g * pairs + p - start) * TILE) * 2), _MM_HINT_T1);
        for (int64_t m = 0; m < height; m++) {
            const xs_t xs = pair_x(x + (m0 + m) * x_stride + 2 * p);
            for (int64_t g = 0; g < count; g++) acc[m][g] = dot_pair(acc[m][g], xs, w[g]);
        }
    }
    for (int64_t m = 0; m < height; m++)
        for (int64_t g = 0; g < count; g++) _mm512_storeu_ps(sums + ((m0 + m) * GROUP + g) * TILE, acc[m][g]);
}

#define BLOCK_ARGS const x_t *x, int64_t x_stride, const uint16_t *packed, int64_t pairs, int64_t first, \
    int64_t start, int64_t end, int64_t m0, float *sums, ahead_t ahead, int64_t height, int64_t count
#define BLOCK(H) static void block_##H(BLOCK_ARGS) { (void)height; (void)count; \
    block(x, x_stride, packed, pairs, first, start, end, m0, sums, ahead, H, GROUP); }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
#define BLOCK8(H) static void block8_##H(BLOCK_ARGS) { (void)height; (void)count; \
    block(x, x_stride, packed, pairs, first, start, end, m0, sums, ahead, H, GROUP8); }
BLOCK8(7) BLOCK8(8)
static void block_any(BLOCK_ARGS) {
    block(x, x_stride, packed, pairs, first, start, end, m0, sums, ahead, height, count);
}
typedef void (*block_fn)(BLOCK_ARGS);

/* Tiles first..first+count-1 (count <= size, the call's tiles a group; `tiles` in all) for every
   row, input pairs in blocks of PAIRS. A block's first rows read its weights from memory; while
   its later rows read them from L2, the next block's (the next group's first, past the last)
   are fetched, so that its first rows do not wait on memory: up to 24 rows (0.93x and 0.95x the
   1.5B target's GEMMs at 12 and 16 rows, EPYC-BF16; 1.06x at 64, so not there). */
static void group(const x_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed, int64_t pairs,
                  int64_t tiles, int64_t first, int64_t count, int64_t size, float *sums) {
    static const block_fn full[] = {block_any, block_1, block_2, block_3, block_4, block_5, block_6};
    const int64_t most = size == GROUP8 ? ROWS8 : ROWS;
    for (int64_t start = 0; start < pairs; start += PAIRS) {
        const int64_t end = start + PAIRS < pairs ? start + PAIRS : pairs;
        ahead_t next = {NULL, 0};
        if (rows <= 4 * ROWS) {  /* past that (a prompt's rows) the fetches, repeated by each row block, cost more */
            if (end < pairs)
                next = (ahead_t){packed + (first * pairs + end) * TILE * 2, end + PAIRS < pairs ? PAIRS : pairs - end};
            else if (first + 2 * size <= tiles)  /* the next group, whole (the last may be partial: not fetched) */
                next = (ahead_t){packed + (first + size) * pairs * TILE * 2, PAIRS < pairs ? PAIRS : pairs};
        }
        for (int64_t m0 = 0; m0 < rows; m0 += most) {
            const int64_t height = m0 + most < rows ? most : rows - m0;
            const ahead_t ahead = m0 ? next : (ahead_t){NULL, 0};
            block_fn fn = block_any;
            if (count == size) fn = size == GROUP8 ? (height == 8 ? block8_8 : block8_7) : full[height];
            fn(x, x_stride, packed, pairs, first, start, end, m0, sums, ahead, height, count);
        }
    }
}

/* y [rows, n] (y_stride elements between rows) = x [rows, k] (x_stride) @ W^T + bias (bf16 [n],
   or NULL), W packed in tiles; k even. scratch: specdec_linear_scratch(rows, k, threads) floats.
   Returns 0. */
int specdec_linear_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed, int64_t n,
                        int64_t k, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads, float *scratch) {
    const int64_t size = rows == 7 || rows == 8 ? GROUP8 : GROUP;
    const int64_t pairs = k / 2, tiles = (n + TILE - 1) / TILE, groups = (tiles + size - 1) / size;
#ifdef __AVX512BF16__
    const x_t *in = x;
    const int64_t in_stride = x_stride;
#else
    float *in = scratch + (int64_t)threads * rows * GROUP * TILE;
    widen(x, rows, x_stride, k, in);
    const int64_t in_stride = k;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && groups > 1)
    for (int64_t gi = 0; gi < groups; gi++) {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float *sums = scratch + (int64_t)thread * rows * GROUP * TILE;
        const int64_t first = gi * size, count = first + size <= tiles ? size : tiles - first;
        group(in, rows, in_stride, packed, pairs, tiles, first, count, size, sums);
        for (int64_t m = 0; m < rows; m++)
            for (int64_t g = 0; g < count; g++) {
                __m512 out = _mm512_loadu_ps(sums + (m * GROUP + g) * TILE);
                const int64_t column = (first + g) * TILE, width = n - column < TILE ? n - column : TILE;
                const __mmask16 mask = (__mmask16)((1u << width) - 1u);
                if (bias) {
                    const __m256i b = _mm256_maskz_loadu_epi16(mask, bias + column);
                    out = _mm512_add_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
                }
                _mm256_mask_storeu_epi16(y + m * y_stride + column, mask, round_bf16(out));
            }
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "vec16.h"

/* 3: AVX2's 8-lane fused multiply-adds on the pairs widened to fp32, the even input first: every
   output's sum is the one the AVX512 widening kernel (2) computes, so rows come out with its bits.

   Sixteen registers hold A_ROWS rows' sums of one tile (two halves of 8 outputs) at a time. Each
   thread streams its tiles (one contiguous stretch of memory) once: a tile's first A_ROWS rows
   run over all its pairs fetching ahead from memory, its next rows read it again from L2, each
   row's sums in registers from the first pair to the last. From A_WIDE rows a call is blocked as
   a GEMM is: A_PAIRS input pairs of a tile, widened to fp32 once (16 KiB, in L1), meet A_BLOCK
   rows (in L2) at a time, the partial sums kept in fp32 between input blocks. */
int specdec_linear_available(void) { return 3; }

#define A_ROWS 6
#define A_PAIRS 128
#define A_BLOCK 192
/* rows from which a call widens each block of weights once. Below it, a tile's later rows read it
   from L2 unwidened: 0.68-0.78x the 1.5B target's GEMMs at 7-20 rows and 0.77x at 64 against
   blocking from 7 rows and widening from 24, the same at 128-256 (EPYC-AVX2) */
#define A_WIDE 128
#define A_AHEAD 1024  /* bytes fetched ahead by the rows that stream a tile from memory */

/* `height` rows from x (k floats apart) of one tile (its pairs at `tile`) over pairs start..end-1,
   into sums (`stride` floats between rows; carried in from them unless start is 0). Inlined with
   height a constant (`tile_rows_H`), the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_rows(const float *x, int64_t k, const uint16_t *tile,
                                                            int64_t start, int64_t end, float *sums, int64_t stride,
                                                            int ahead, const int64_t height) {
    __m256 lo[A_ROWS], hi[A_ROWS];
    _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
        lo[m] = start ? _mm256_loadu_ps(sums + m * stride) : _mm256_setzero_ps();
        hi[m] = start ? _mm256_loadu_ps(sums + m * stride + 8) : _mm256_setzero_ps();
    }
    for (int64_t p = start; p < end; p++) {
        const uint16_t *at = tile + p * TILE * 2;  /* one cache line */
        if (ahead) _mm_prefetch((const char *)at + A_AHEAD, _MM_HINT_T0);
        const __m256i w_lo = _mm256_loadu_si256((const __m256i *)at);
        const __m256i w_hi = _mm256_loadu_si256((const __m256i *)(at + TILE));
        const __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(w_lo, 16));
        const __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(w_hi, 16));
        _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
            const __m256 xs = _mm256_broadcast_ss(x + m * k + 2 * p);
            lo[m] = _mm256_fmadd_ps(xs, even_lo, lo[m]);
            hi[m] = _mm256_fmadd_ps(xs, even_hi, hi[m]);
        }
        const __m256 odd_lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w_lo, 16), 16));
        const __m256 odd_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w_hi, 16), 16));
        _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
            const __m256 xs = _mm256_broadcast_ss(x + m * k + 2 * p + 1);
            lo[m] = _mm256_fmadd_ps(xs, odd_lo, lo[m]);
            hi[m] = _mm256_fmadd_ps(xs, odd_hi, hi[m]);
        }
    }
    _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
        _mm256_storeu_ps(sums + m * stride, lo[m]);
        _mm256_storeu_ps(sums + m * stride + 8, hi[m]);
    }
}

/* The same sums from a tile's block of pairs already widened to fp32 (`wide` [pairs][2][16], the
   even input's 16 weights, then the odd one's), read straight into the multiply-adds: a long call
   widens each block once for all its rows. */
static inline __attribute__((always_inline)) void wide_rows(const float *x, int64_t k, const float *wide,
                                                            int64_t start, int64_t end, float *sums, int64_t stride,
                                                            const int64_t height) {
    __m256 lo[A_ROWS], hi[A_ROWS];
    _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
        lo[m] = start ? _mm256_loadu_ps(sums + m * stride) : _mm256_setzero_ps();
        hi[m] = start ? _mm256_loadu_ps(sums + m * stride + 8) : _mm256_setzero_ps();
    }
    for (int64_t i = 2 * start; i < 2 * end; i++) {  /* input i: pair i / 2, even then odd */
        const __m256 w_lo = _mm256_load_ps(wide + (i - 2 * start) * TILE);
        const __m256 w_hi = _mm256_load_ps(wide + (i - 2 * start) * TILE + 8);
        _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
            const __m256 xs = _mm256_broadcast_ss(x + m * k + i);
            lo[m] = _mm256_fmadd_ps(xs, w_lo, lo[m]);
            hi[m] = _mm256_fmadd_ps(xs, w_hi, hi[m]);
        }
    }
    _Pragma("GCC unroll 8") for (int64_t m = 0; m < height; m++) {
        _mm256_storeu_ps(sums + m * stride, lo[m]);
        _mm256_storeu_ps(sums + m * stride + 8, hi[m]);
    }
}

/* a tile's pairs start..end-1 -> wide [pairs][2][16] fp32, exactly */
static void widen_tile(const uint16_t *tile, int64_t start, int64_t end, float *wide) {
    for (int64_t p = start; p < end; p++) {
        const uint16_t *at = tile + p * TILE * 2;
        float *out = wide + (p - start) * 2 * TILE;
        for (int half = 0; half < 2; half++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(at + half * TILE));
            _mm256_store_ps(out + half * 8, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            _mm256_store_ps(out + TILE + half * 8,
                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w, 16), 16)));
        }
    }
}

#define WIDE_ROWS(H) static void wide_rows_##H(const float *x, int64_t k, const float *wide, int64_t start, \
    int64_t end, float *sums, int64_t stride) { wide_rows(x, k, wide, start, end, sums, stride, H); }
WIDE_ROWS(1) WIDE_ROWS(2) WIDE_ROWS(3) WIDE_ROWS(4) WIDE_ROWS(5) WIDE_ROWS(6)
typedef void (*wide_rows_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t);
static const wide_rows_fn wide_by_height[] = {NULL, wide_rows_1, wide_rows_2, wide_rows_3, wide_rows_4, wide_rows_5,
                                              wide_rows_6};

#define TILE_ROWS_ARGS const float *x, int64_t k, const uint16_t *tile, int64_t start, int64_t end, float *sums, \
    int64_t stride, int ahead
#define TILE_ROWS(H) static void tile_rows_##H(TILE_ROWS_ARGS) { \
    tile_rows(x, k, tile, start, end, sums, stride, ahead, H); }
TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6)
typedef void (*tile_rows_fn)(TILE_ROWS_ARGS);
static const tile_rows_fn by_height[] = {NULL, tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4, tile_rows_5,
                                         tile_rows_6};

int specdec_linear_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed, int64_t n,
                        int64_t k, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads, float *scratch) {
    const int64_t pairs = k / 2, tiles = (n + TILE - 1) / TILE, stride = tiles * TILE;
    float *in = scratch, *sums = scratch + rows * k;  /* sums [rows][tiles * 16] */
    widen(x, rows, x_stride, k, in);
    const int widened = rows >= A_WIDE;
    const int64_t block = widened ? A_PAIRS : pairs;
#pragma omp parallel num_threads(threads) if (threads > 1 && tiles > 1)
    {
        int thread = 0, count = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        count = omp_get_num_threads();
#endif
        const int64_t first = tiles * thread / count, last = tiles * (thread + 1) / count;
        float wide[A_PAIRS * 2 * TILE] __attribute__((aligned(32)));
        for (int64_t start = 0; start < pairs; start += block) {
            const int64_t end = start + block < pairs ? start + block : pairs;
            for (int64_t mb = 0; mb < rows; mb += A_BLOCK)
                for (int64_t t = first; t < last; t++) {
                    const uint16_t *tile = packed + t * pairs * TILE * 2;
                    if (widened) widen_tile(tile, start, end, wide);
                    const int64_t top = mb + A_BLOCK < rows ? mb + A_BLOCK : rows;
                    for (int64_t m0 = mb, height; m0 < top; m0 += height) {
                        /* blocks of even height (7 rows: 4 and 3), not A_ROWS and a short one
                           whose few sums chain their multiply-adds with nothing to interleave */
                        const int64_t left = top - m0, blocks = (left + A_ROWS - 1) / A_ROWS;
                        height = (left + blocks - 1) / blocks;
                        float *at = sums + m0 * stride + t * TILE;
                        if (!widened)
                            by_height[height](in + m0 * k, k, tile, start, end, at, stride, m0 == mb);
                        else
                            wide_by_height[height](in + m0 * k, k, wide, start, end, at, stride);
                    }
                }
        }
        for (int64_t m = 0; m < rows; m++)
            for (int64_t column = first * TILE; column < last * TILE && column < n; column++) {
                float out = sums[m * stride + column];
                if (bias) {
                    const uint32_t bits = (uint32_t)bias[column] << 16;
                    float b;
                    memcpy(&b, &bits, sizeof b);
                    out += b;
                }
                y[m * y_stride + column] = to_bf16(out);
            }
    }
    return 0;
}

#else

int specdec_linear_available(void) { return 0; }

int specdec_linear_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed, int64_t n,
                        int64_t k, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads, float *scratch) {
    (void)x; (void)rows; (void)x_stride; (void)packed; (void)n; (void)k; (void)bias; (void)y; (void)y_stride;
    (void)threads; (void)scratch;
    return -1;
}

#endif
