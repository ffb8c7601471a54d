/* bf16 linear layers on CPUs with AMX, exact by construction (specdec, Apache-2.0).

   y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]), W packed as for linear.c ([n / 16][k / 2][16][2]:
   backends/native.py, `pack_tiles`), which is also the layout of AMX's B tiles: 16 input pairs of a
   tile of 16 outputs are one 1 KiB tile, 64 bytes a row.

   AMX's TDPBF16PS, over 16 input pairs, sums the even products of each output in one fp32 lane
   and the odd ones in another, pair after pair (each step rounded to nearest even), and then adds
   the two lanes' sum to the accumulator; denormal inputs count as zero, denormal results are
   flushed (measured on a Xeon with AMX: every bit of 256 outputs over 1,536 inputs, where every
   other order tried differed in most). Every call runs on the tiles, a decode step's row padded
   to 16 (the weights stream as fast as for 16 rows: 0.76x oneDNN's AMX kernel's time on the 1.5B
   target's GEMMs at 1 row, 0.82-0.86x at 2-8); inputs that are no whole number of blocks of 16
   pairs compute the very same sums with AVX-512 FMAs in that order. A row comes out with the
   same bits whichever path its call takes and whatever else the call holds
   (docs/kernels.md#tiled-bf16-linears-on-amx). */

#include <stdint.h>
#include <string.h>

#define TILE 16     /* outputs per tile */
#define BLOCK 16    /* input pairs one TDPBF16PS sums per output */
#define GROUP 4     /* tiles a thread works on at once (AMX: accumulator tiles 0-3) */
#define FEW 2       /* tiles the FMA path keeps at once */
#define FEW_ROWS 4  /* rows the FMA path keeps in registers at once */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* calls of at least this many rows run on the tiles (the rest on FMAs: the same bits either way,
   which tests check by moving it; on FMAs 2-8 rows took 1.3-2.2x the time, 1 row about the same) */
static int64_t amx_rows = 1;
int64_t specdec_linear_amx_least_rows(int64_t rows) {
    const int64_t before = amx_rows;
    if (rows > 0) amx_rows = rows;
    return before;
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MXCSR_DAZ_FTZ 0x8040

/* Linux lends a process AMX's tile state only when asked; 1 once granted (every thread then may). */
int specdec_linear_amx_available(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* The fp32 sums of `count` tiles' outputs, [16 rows][count * 16], rounded to bf16 with the bias
   added, into rows m0..m0+height-1 of y. */
static void store(const float *sums, int64_t sums_stride, int64_t height, int64_t m0, int64_t first, int64_t count,
                  int64_t n, const uint16_t *bias, uint16_t *y, int64_t y_stride) {
    for (int64_t m = 0; m < height; m++)
        for (int64_t g = 0; g < count; g++) {
            __m512 out = _mm512_loadu_ps(sums + m * sums_stride + g * TILE);
            const int64_t column = (first + g) * TILE, width = n - column < TILE ? n - column : TILE;
            const __mmask16 mask = (__mmask16)((1u << width) - 1u);
            if (bias) {
                const __m256i b = _mm256_maskz_loadu_epi16(mask, bias + column);
                out = _mm512_add_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
            }
            _mm256_mask_storeu_epi16(y + (m0 + m) * y_stride + column, mask, (__m256i)_mm512_cvtneps_pbh(out));
        }
}

/* Rows m0..m0+height-1 (height <= FEW_ROWS) of tiles first..first+count-1 (count <= FEW) by FMAs
   in TDPBF16PS's order: per block of 16 pairs, an even and an odd lane from zero, then their sum
   added to the accumulator. Inlined with height and count constants, the sums stay in registers. */
static inline __attribute__((always_inline)) void few(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                                                      int64_t pairs, int64_t first, int64_t m0, float *sums,
                                                      const int64_t height, const int64_t count) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[FEW_ROWS][FEW];
    for (int64_t m = 0; m < height; m++)
        for (int64_t g = 0; g < count; g++) acc[m][g] = _mm512_setzero_ps();
    for (int64_t start = 0; start < pairs; start += BLOCK) {
        const int64_t end = start + BLOCK < pairs ? start + BLOCK : pairs;
        __m512 even[FEW_ROWS][FEW], odd[FEW_ROWS][FEW];
        for (int64_t m = 0; m < height; m++)
            for (int64_t g = 0; g < count; g++) even[m][g] = odd[m][g] = _mm512_setzero_ps();
        for (int64_t p = start; p < end; p++) {
            __m512 w_even[FEW], w_odd[FEW];
            for (int64_t g = 0; g < count; g++) {
                const __m512i w = _mm512_loadu_si512(packed + (((first + g) * pairs + p) * TILE) * 2);
                w_even[g] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                w_odd[g] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
            }
            for (int64_t m = 0; m < height; m++) {
                uint32_t pair;
                memcpy(&pair, x + (m0 + m) * x_stride + 2 * p, sizeof pair);
                const __m512 x_even = _mm512_castsi512_ps(_mm512_set1_epi32((int)(pair << 16)));
                const __m512 x_odd = _mm512_castsi512_ps(_mm512_set1_epi32((int)(pair & 0xFFFF0000u)));
                for (int64_t g = 0; g < count; g++) {  /* a bf16 product is exact in fp32: one rounding, as AMX's */
                    even[m][g] = _mm512_fmadd_ps(x_even, w_even[g], even[m][g]);
                    odd[m][g] = _mm512_fmadd_ps(x_odd, w_odd[g], odd[m][g]);
                }
            }
        }
        for (int64_t m = 0; m < height; m++)
            for (int64_t g = 0; g < count; g++)
                acc[m][g] = _mm512_add_ps(acc[m][g], _mm512_add_ps(even[m][g], odd[m][g]));
    }
    for (int64_t m = 0; m < height; m++)
        for (int64_t g = 0; g < count; g++) _mm512_storeu_ps(sums + m * FEW * TILE + g * TILE, acc[m][g]);
}

#define FEW_ARGS const uint16_t *x, int64_t x_stride, const uint16_t *packed, int64_t pairs, int64_t first, \
    int64_t m0, float *sums, int64_t height, int64_t count
#define FEW_FN(H) static void few_##H(FEW_ARGS) { (void)height; (void)count; \
    few(x, x_stride, packed, pairs, first, m0, sums, H, FEW); }
FEW_FN(1) FEW_FN(2) FEW_FN(3) FEW_FN(4)
static void few_any(FEW_ARGS) { few(x, x_stride, packed, pairs, first, m0, sums, height, count); }
typedef void (*few_fn)(FEW_ARGS);

/* Tiles first..first+count-1 (count <= GROUP) of every row on AMX: x padded to whole blocks of 16
   rows ([rows16][k], k a multiple of 32), each block of rows over every input block, the group's
   weights read from memory by the first and from cache by the rest. `sums`: 16 x GROUP x 16 floats. */
static void tiles(const uint16_t *x, int64_t rows16, int64_t k, const uint16_t *packed, int64_t pairs, int64_t first,
                  int64_t count, int64_t rows, int64_t n, const uint16_t *bias, uint16_t *y, int64_t y_stride,
                  float *sums) {
    const uint16_t *w = packed + first * pairs * TILE * 2;
    const int64_t tile_values = pairs * TILE * 2;
    for (int64_t m0 = 0; m0 < rows16; m0 += 16) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t p = 0; p < pairs; p += BLOCK) {
            _tile_loadd(4, x + m0 * k + 2 * p, k * 2);
            const uint16_t *b = w + p * TILE * 2;
            _tile_loadd(5, b, TILE * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (count > 1) { _tile_loadd(6, b + tile_values, TILE * 4); _tile_dpbf16ps(1, 4, 6); }
            if (count > 2) { _tile_loadd(5, b + 2 * tile_values, TILE * 4); _tile_dpbf16ps(2, 4, 5); }
            if (count > 3) { _tile_loadd(6, b + 3 * tile_values, TILE * 4); _tile_dpbf16ps(3, 4, 6); }
        }
        const int64_t stride = GROUP * TILE * 4;
        _tile_stored(0, sums, stride);
        if (count > 1) _tile_stored(1, sums + TILE, stride);
        if (count > 2) _tile_stored(2, sums + 2 * TILE, stride);
        if (count > 3) _tile_stored(3, sums + 3 * TILE, stride);
        const int64_t height = rows - m0 < 16 ? rows - m0 : 16;
        store(sums, GROUP * TILE, height, m0, first, count, n, bias, y, y_stride);
    }
}

/* the floats of scratch space specdec_linear_amx_bf16 needs for `rows` rows of `k` inputs on
   `threads` threads: each thread's sums, and x padded to whole blocks of 16 rows */
int64_t specdec_linear_amx_scratch(int64_t rows, int64_t k, int threads) {
    return (int64_t)threads * 16 * GROUP * TILE + ((rows + 15) / 16) * 16 * k / 2 + 16;
}

/* y [rows, n] (y_stride elements between rows) = x [rows, k] (x_stride) @ W^T + bias (bf16 [n],
   or NULL), W packed in tiles; k even. scratch: specdec_linear_amx_scratch(rows, k, threads)
   floats, 64-byte aligned. Returns 0, or -1 where the process may not use AMX. */
int specdec_linear_amx_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed, int64_t n,
                            int64_t k, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads,
                            float *scratch) {
    const int64_t pairs = k / 2, tile_count = (n + TILE - 1) / TILE;
    const int on_tiles = rows >= amx_rows && pairs % BLOCK == 0;
    if (on_tiles && !specdec_linear_amx_available()) return -1;
    const int64_t size = on_tiles ? GROUP : FEW, groups = (tile_count + size - 1) / size;
    const int64_t rows16 = (rows + 15) / 16 * 16;
    uint16_t *padded = (uint16_t *)(scratch + (int64_t)threads * 16 * GROUP * TILE);
    if (on_tiles) {  /* whole blocks of 16 rows, contiguous; the rows past `rows` zero */
        for (int64_t m = 0; m < rows; m++) memcpy(padded + m * k, x + m * x_stride, k * 2);
        memset(padded + rows * k, 0, (rows16 - rows) * k * 2);
    }
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        const unsigned int mxcsr = _mm_getcsr();
        _mm_setcsr(mxcsr | MXCSR_DAZ_FTZ);  /* as AMX: denormal inputs zero, denormal results flushed */
        float *sums = scratch + (int64_t)thread * 16 * GROUP * TILE;
        if (on_tiles) {
            tile_config_t config;
            memset(&config, 0, sizeof config);
            config.palette = 1;
            for (int t = 0; t < 4; t++) { config.rows[t] = 16; config.colsb[t] = TILE * 4; }  /* sums */
            config.rows[4] = 16; config.colsb[4] = BLOCK * 4;  /* 16 rows of x, 16 pairs each */
            config.rows[5] = config.rows[6] = BLOCK; config.colsb[5] = config.colsb[6] = TILE * 4;  /* weights */
            _tile_loadconfig(&config);
        }
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t first = gi * size, count = first + size <= tile_count ? size : tile_count - first;
            if (on_tiles) {
                tiles(padded, rows16, k, packed, pairs, first, count, rows, n, bias, y, y_stride, sums);
                continue;
            }
            static const few_fn full[] = {few_any, few_1, few_2, few_3, few_4};
            for (int64_t m0 = 0; m0 < rows; m0 += FEW_ROWS) {
                const int64_t height = m0 + FEW_ROWS < rows ? FEW_ROWS : rows - m0;
                (count == FEW ? full[height] : few_any)(x, x_stride, packed, pairs, first, m0, sums, height, count);
                store(sums, FEW * TILE, height, m0, first, count, n, bias, y, y_stride);
            }
        }
        if (on_tiles) _tile_release();
        _mm_setcsr(mxcsr);
    }
    return 0;
}

#else

int specdec_linear_amx_available(void) { return 0; }

int64_t specdec_linear_amx_least_rows(int64_t rows) { (void)rows; return 0; }

int64_t specdec_linear_amx_scratch(int64_t rows, int64_t k, int threads) { (void)rows; (void)k; (void)threads; return 0; }

int specdec_linear_amx_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed, int64_t n,
                            int64_t k, const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads,
                            float *scratch) {
    (void)x; (void)rows; (void)x_stride; (void)packed; (void)n; (void)k; (void)bias; (void)y; (void)y_stride;
    (void)threads; (void)scratch;
    return -1;
}

#endif
