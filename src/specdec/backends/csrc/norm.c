/* RMSNorm over bf16 rows in one call (specdec, Apache-2.0).

   Llama, Qwen and Mistral normalise each row of a layer's input twice a layer: in eager torch that
   is seven ops a call (to fp32, square, mean, add, rsqrt, multiply, back to bf16, times the
   weight), fifty-seven calls a pass of the 1.5B target, each paying its dispatch. Here one call.

   Arithmetic, as transformers' RMSNorm does it, a row on its own (so its result never depends on
   what shares the call): the row in fp32; the mean of its squares, summed in 16 interleaved
   partial sums, then those pairwise; x / sqrt(mean + eps) rounded to bf16; times the weight,
   rounded to bf16 once more. Only the order of the squares' sum differs from torch's. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

/* out[r] = bf16(weight * bf16(x[r] / sqrt(mean(x[r]^2) + eps))) for rows of `width` bf16 values,
   rows x_stride (out_stride) elements apart */
void specdec_rms_norm_bf16(int64_t rows, int64_t width, const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                           float eps, uint16_t *out, int64_t out_stride, int threads) {
    const int64_t chunks = (width + LANES - 1) / LANES;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)(x + r * x_stride);
        v16 squares = {0};
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n = width - c * LANES < LANES ? width - c * LANES : LANES;
            const v16 v = n == LANES ? load16(row + c * LANES * 2, 1) : load_part(row + c * LANES * 2, n, 1);
            squares += v * v;
        }
        const float scale = 1.0f / sqrtf(total16(squares) / (float)width + eps);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n = width - c * LANES < LANES ? width - c * LANES : LANES;
            const char *w = (const char *)(weight + c * LANES);
            const v16 v = n == LANES ? load16(row + c * LANES * 2, 1) : load_part(row + c * LANES * 2, n, 1);
            const v16 g = n == LANES ? load16(w, 1) : load_part(w, n, 1);
            store_bf16(out + r * out_stride + c * LANES, round_bf16(g * round_bf16(v * scale)), n);
        }
    }
}
