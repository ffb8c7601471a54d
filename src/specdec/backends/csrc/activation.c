/* The gated MLP's middle, silu(gate) * up, in one call over a merged gate/up GEMM's output
   (specdec, Apache-2.0).

   A SwiGLU MLP (Llama, Qwen, Mistral) computes down(silu(gate(x)) * up(x)). With gate and up one
   GEMM (backends/merged.py), eager torch copies each half out, runs silu, then the product: three
   passes over the rows and two copies. Here one pass reads both halves where they lie.

   Arithmetic, element by element (so a row's result never depends on what shares the call): the
   gate in fp32, silu(g) = g * sigmoid(g) with e^-|g| by the shared polynomial (vec16.h; below -80,
   torch's g / (1 + e^-g) with the C library's exp), rounded to bf16 as torch's activation output
   is; times up in fp32; rounded to bf16 once more. A different exp than torch's, so an fp32 value
   near a bf16 rounding boundary may round the other way: about one element in 10^5. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* The lanes of a chunk whose gate g is below -80, where e^-|g| nears or passes the polynomial's
   floor (-87): torch's formula, g / (1 + e^-g), with the C library's exp (-0 past exp's range, as
   torch gives), times up u, written over the chunk's n outputs at dst. Apart and cold, so that the
   loop calling it keeps its values in registers; it takes the values that loop read (the output
   may have been written over the input since). */
static __attribute__((noinline, cold)) void far_lanes(uint16_t *dst, const v16 *g, const v16 *u, int64_t n) {
    for (int64_t l = 0; l < n; l++)
        if ((*g)[l] < -80.0f) {
            const v16 silu = round_bf16((v16){(*g)[l] / (1.0f + expf(-(*g)[l]))});  /* lane 0; no +0 added to a -0 */
            store_bf16(dst + l, round_bf16(silu * (*u)[l]), 1);
        }
}

/* rows x width outputs: out[r][i] = bf16(bf16(silu(g)) * u) for g = in[r][i], u = in[r][width + i]
   (bf16; rows in_stride and out_stride elements apart) */
void specdec_silu_mul_bf16(int64_t rows, int64_t width, const uint16_t *in, int64_t in_stride, uint16_t *out,
                           int64_t out_stride, int threads) {
    const int64_t chunks = (width + LANES - 1) / LANES, tasks = rows * chunks;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 256)
    {
#ifdef _OPENMP
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
        const int64_t team = 1, me = 0;
#endif
        /* a contiguous share of the (row, chunk) tasks each, walked without dividing */
        const int64_t first = tasks * me / team, last = tasks * (me + 1) / team;
        int64_t r = first / chunks, c = first % chunks * LANES;
        for (int64_t t = first; t < last; t++) {
            const int64_t n = width - c < LANES ? width - c : LANES;
            const char *gate = (const char *)(in + r * in_stride + c);
            const char *up = (const char *)(in + r * in_stride + width + c);
            const v16 g = n == LANES ? load16(gate, 1) : load_part(gate, n, 1);
            const v16 u = n == LANES ? load16(up, 1) : load_part(up, n, 1);
            const v16 e = exp16(-(v16)((i16)g & 0x7fffffff));  /* e^-|g|, in (0, 1] */
            const i16 negative = g < 0.0f;
            const v16 numerator = (v16)(((i16)e & negative) | ((i16)((v16){0} + 1.0f) & ~negative));
            store_bf16(out + r * out_stride + c, round_bf16(round_bf16(g * (numerator / (1.0f + e))) * u), n);
            if (any16(g < -80.0f)) far_lanes(out + r * out_stride + c, &g, &u, n);
            c += LANES;
            if (c >= width) c = 0, r++;
        }
    }
}
