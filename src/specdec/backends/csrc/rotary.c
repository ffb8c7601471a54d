/* Rotary position embedding of a pass's queries and keys, read from their stacked q/k/v GEMM's
   output (specdec, Apache-2.0).

   out[h][t][i] = bf16(bf16(x[i] * cos[t][i]) + bf16(r[i] * sin[t][i])) for head h of row t, with
   r = rotate_half(x) = (-x[half:], x[:half]): transformers' apply_rotary_pos_emb as eager torch
   rounds it in bf16 (each product, then their sum, to nearest even). Each element on its own, so
   a row's result never depends on what shares its pass. */

#include <stdint.h>
#include <string.h>

#include "vec16.h"

static inline float bf16_float(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float rounded(float f) { return bf16_float(to_bf16(f)); }

/* One head of one row: src [dim] -> dst [dim], cos and sin [dim]. Rounded with integer
   round-to-nearest-even (`round_bf16`), as torch rounds, subnormals kept (the CPU's bf16
   conversion instruction would flush them). */
static void rotate(const uint16_t *src, const uint16_t *cos, const uint16_t *sin, int64_t dim, uint16_t *dst) {
    const int64_t half = dim / 2;
    int64_t i = 0;
    for (; i + LANES <= half; i += LANES) {
        const v16 a = load16((const char *)(src + i), 1), b = load16((const char *)(src + half + i), 1);
        const v16 low = round_bf16(round_bf16(a * load16((const char *)(cos + i), 1))
                                   + round_bf16(-b * load16((const char *)(sin + i), 1)));
        const v16 high = round_bf16(round_bf16(b * load16((const char *)(cos + half + i), 1))
                                    + round_bf16(a * load16((const char *)(sin + half + i), 1)));
        store_bf16(dst + i, low, LANES);
        store_bf16(dst + half + i, high, LANES);
    }
    for (; i < half; i++) {
        const float a = bf16_float(src[i]), b = bf16_float(src[half + i]);
        dst[i] = to_bf16(rounded(a * bf16_float(cos[i])) + rounded(-b * bf16_float(sin[i])));
        dst[half + i] = to_bf16(rounded(b * bf16_float(cos[half + i])) + rounded(a * bf16_float(sin[half + i])));
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
