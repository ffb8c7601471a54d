/* One-query attention for many rows at once, each row over its own keys (specdec, Apache-2.0).

   A row is one query position of one sequence: its heads attend to the keys of its runs (spans of
   its sequence's cache, in order), grouped-query heads reading key/value head h / groups. Every
   (row, key/value head) is computed by the same code from its own inputs alone, in one fixed
   order, so a row's output does not depend on which other rows share the call: a decode step's
   one row and the same row among a batch's hundreds get the same bits (backends/rows.py).

   Arithmetic: fp32 throughout (products of bf16 values are exact in fp32), each dot product summed
   in 16 interleaved partial sums, then those pairwise (16 keys' sums reduced together with the
   same additions, `totals16`: 1.5x the kernel's speed, the bits unchanged but NaNs' payloads);
   softmax with the row's maximum subtracted (e^x by a polynomial, vectorised); the weighted sum
   of values in key order; one rounding to the output's dtype. Needs heads / kv_heads <= 16. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* value chunks whose sums one pass over the keys carries: a constant, so that (up to 6 query heads a
   key/value head) the sums stay in registers, where a run-time width kept them in memory (1.2x the
   kernel's time on a prompt's rows, EPYC-BF16) */
#define PV_WIDTH 4

/* One (row, key/value head): `groups` query heads (at most 16) over the row's keys (head sizes
   that are no multiple of LANES end in a chunk padded with zeros). Returns 0, or -1 where memory
   ran out. Inlined with `groups` a constant (`task_for`), its per-head partial sums stay in
   registers. */
static inline __attribute__((always_inline)) int one_task(
                    int64_t row, int64_t kv_head, int64_t groups, int64_t dim, int64_t vdim, float scale, int bf16,
                    const char *query, int64_t q_head_stride, const int64_t *q_offsets, const int64_t *row_seq,
                    const int64_t *row_runs, const int64_t *runs, const int64_t *k_ptrs, const int64_t *v_ptrs,
                    const int64_t *k_head_strides, const int64_t *v_head_strides, char *out, int64_t heads) {
    const int64_t size = bf16 ? 2 : 4, chunks = (dim + LANES - 1) / LANES, vchunks = (vdim + LANES - 1) / LANES;
    const int64_t tail = dim - (chunks - 1) * LANES, vtail = vdim - (vchunks - 1) * LANES;
    const int64_t first = row_runs[row], last = row_runs[row + 1];
    int64_t count = 0;
    for (int64_t r = first; r < last; r++) count += runs[2 * r + 1] - runs[2 * r];
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    v16 *q = aligned_alloc(64, sizeof(v16) * (size_t)(groups * chunks + groups * vchunks + LANES * chunks) +
                                   sizeof(float) * (size_t)(groups * padded));
    if (!q) return -1;
    v16 *acc = q + groups * chunks;
    v16 *block = acc + groups * vchunks;  /* 16 keys in fp32 */
    float *scores = (float *)(block + LANES * chunks);
    const int64_t s = row_seq[row];
    const char *keys = (const char *)(intptr_t)k_ptrs[s] + kv_head * k_head_strides[s] * size;
    const char *values = (const char *)(intptr_t)v_ptrs[s] + kv_head * v_head_strides[s] * size;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < chunks; c++) {
            const char *at = query + (q_offsets[row] + (kv_head * groups + g) * q_head_stride + c * LANES) * size;
            q[g * chunks + c] = c + 1 < chunks || tail == LANES ? load16(at, bf16) : load_part(at, tail, bf16);
        }

    /* scores: q . k for each key, in key order; a run's keys 16 at a time (converted to fp32 once
       for all the groups, their sums reduced together: `totals16`), the rest one at a time */
    int64_t n = 0;
    for (int64_t r = first; r < last; r++) {
        int64_t j = runs[2 * r];
        for (; j + LANES <= runs[2 * r + 1]; j += LANES, n += LANES) {
            for (int64_t i = 0; i < LANES; i++) {
                const char *k = keys + (j + i) * dim * size;
                for (int64_t c = 0; c < chunks; c++)
                    block[i * chunks + c] = c + 1 < chunks || tail == LANES ? load16(k + c * LANES * size, bf16)
                                                                            : load_part(k + c * LANES * size, tail, bf16);
            }
            for (int64_t g = 0; g < groups; g++) {
                v16 part[LANES];
                for (int64_t i = 0; i < LANES; i++) part[i] = (v16){0};
                for (int64_t c = 0; c < chunks; c++) {
                    const v16 qc = q[g * chunks + c];
                    for (int64_t i = 0; i < LANES; i++) part[i] = fma16(qc, block[i * chunks + c], part[i]);
                }
                const v16 total = totals16(part) * scale;
                memcpy(scores + g * padded + n, &total, sizeof total);
            }
        }
        for (; j < runs[2 * r + 1]; j++, n++) {
            const char *k = keys + j * dim * size;
            v16 part[16];
            for (int64_t g = 0; g < groups; g++) part[g] = (v16){0};
            for (int64_t c = 0; c < chunks; c++) {
                const v16 kc = c + 1 < chunks || tail == LANES ? load16(k + c * LANES * size, bf16)
                                                               : load_part(k + c * LANES * size, tail, bf16);
                for (int64_t g = 0; g < groups; g++) part[g] = fma16(q[g * chunks + c], kc, part[g]);
            }
            for (int64_t g = 0; g < groups; g++) scores[g * padded + n] = total16(part[g]) * scale;
        }
    }
    /* softmax weights, unnormalised: e^(score - max), the padding's set to 0 */
    float denominator[16];
    for (int64_t g = 0; g < groups; g++) {
        float *row_scores = scores + g * padded, top = -INFINITY;
        for (int64_t i = 0; i < count; i++) top = row_scores[i] > top ? row_scores[i] : top;
        for (int64_t i = count; i < padded; i++) row_scores[i] = top;
        v16 sum = {0};
        for (int64_t i = 0; i < padded; i += LANES) {
            v16 x;
            memcpy(&x, row_scores + i, sizeof x);
            v16 e = exp16(x - top);
            for (int l = 0; l < LANES; l++)
                if (i + l >= count) e[l] = 0.0f;
            memcpy(row_scores + i, &e, sizeof e);
            sum += e;
        }
        denominator[g] = total16(sum);
    }
    /* the weighted sum of values, in key order; PV_WIDTH chunks at a time (a constant, so that the
       groups' partial sums stay in registers), the last ones one at a time */
    for (int64_t c = 0; c < vchunks;) {
        if (c + PV_WIDTH <= vchunks && (c + PV_WIDTH < vchunks || vtail == LANES)) {
            v16 sum[16][PV_WIDTH];
            for (int64_t g = 0; g < groups; g++)
                for (int64_t w = 0; w < PV_WIDTH; w++) sum[g][w] = (v16){0};
            n = 0;
            for (int64_t r = first; r < last; r++)
                for (int64_t j = runs[2 * r]; j < runs[2 * r + 1]; j++, n++) {
                    const char *v = values + (j * vdim + c * LANES) * size;
                    v16 vc[PV_WIDTH];
                    for (int64_t w = 0; w < PV_WIDTH; w++) vc[w] = load16(v + w * LANES * size, bf16);
                    for (int64_t g = 0; g < groups; g++) {
                        const float weight = scores[g * padded + n];
                        for (int64_t w = 0; w < PV_WIDTH; w++) sum[g][w] += weight * vc[w];
                    }
                }
            for (int64_t g = 0; g < groups; g++)
                for (int64_t w = 0; w < PV_WIDTH; w++) acc[g * vchunks + c + w] = sum[g][w];
            c += PV_WIDTH;
            continue;
        }
        v16 sum[16];
        for (int64_t g = 0; g < groups; g++) sum[g] = (v16){0};
        n = 0;
        for (int64_t r = first; r < last; r++)
            for (int64_t j = runs[2 * r]; j < runs[2 * r + 1]; j++, n++) {
                const char *v = values + (j * vdim + c * LANES) * size;
                const v16 vc = c + 1 < vchunks || vtail == LANES ? load16(v, bf16) : load_part(v, vtail, bf16);
                for (int64_t g = 0; g < groups; g++) sum[g] += scores[g * padded + n] * vc;
            }
        for (int64_t g = 0; g < groups; g++) acc[g * vchunks + c] = sum[g];
        c += 1;
    }
    for (int64_t g = 0; g < groups; g++) {
        const float inverse = 1.0f / denominator[g];
        char *o = out + (row * heads + kv_head * groups + g) * vdim * size;
        for (int64_t c = 0; c < vchunks; c++) {
            const v16 x = acc[g * vchunks + c] * inverse;
            for (int l = 0; l < (c + 1 < vchunks ? LANES : vtail); l++) {
                if (bf16) ((uint16_t *)o)[c * LANES + l] = to_bf16(x[l]);
                else ((float *)o)[c * LANES + l] = x[l];
            }
        }
    }
    free(q);
    return 0;
}

#define TASK_ARGS int64_t row, int64_t kv_head, int64_t groups, int64_t dim, int64_t vdim, float scale, int bf16, \
    const char *query, int64_t q_head_stride, const int64_t *q_offsets, const int64_t *row_seq, \
    const int64_t *row_runs, const int64_t *runs, const int64_t *k_ptrs, const int64_t *v_ptrs, \
    const int64_t *k_head_strides, const int64_t *v_head_strides, char *out, int64_t heads
#define TASK_PASS dim, vdim, scale, bf16, query, q_head_stride, q_offsets, row_seq, row_runs, runs, k_ptrs, v_ptrs, \
    k_head_strides, v_head_strides, out, heads
#define TASK(G) static int task_##G(TASK_ARGS) { (void)groups; return one_task(row, kv_head, G, TASK_PASS); }
TASK(1) TASK(2) TASK(3) TASK(4) TASK(5) TASK(6) TASK(7) TASK(8)
static int task_any(TASK_ARGS) { return one_task(row, kv_head, groups, TASK_PASS); }
typedef int (*task_fn)(TASK_ARGS);

/* the task specialised for `groups` query heads per key/value head (any count up to 16) */
static task_fn task_for(int64_t groups) {
    static const task_fn special[] = {task_1, task_1, task_2, task_3, task_4, task_5, task_6, task_7, task_8};
    return groups <= 8 ? special[groups] : task_any;
}

/* rows: query rows to compute; row i's heads start q_offsets[i] elements into query, heads
   q_head_stride elements apart (each head's dim values contiguous); it is a row of sequence
   row_seq[i], over the key spans runs[2r]..runs[2r+1] for r in row_runs[i]..row_runs[i+1]; sequence s's keys (values):
   [kv_heads, positions, dim (vdim)] from k_ptrs[s] (v_ptrs[s]), heads k_head_strides[s]
   (v_head_strides[s]) elements apart, positions contiguous. out: [rows, heads, vdim], contiguous.
   Returns 0, or -1 where memory ran out. */
int specdec_one_query_rows(int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t vdim, float scale,
                           int bf16, int threads, const void *query, int64_t q_head_stride, const int64_t *q_offsets,
                           const int64_t *row_seq, const int64_t *row_runs,
                           const int64_t *runs, const int64_t *k_ptrs, const int64_t *v_ptrs,
                           const int64_t *k_head_strides, const int64_t *v_head_strides, void *out) {
    const int64_t groups = heads / kv_heads, tasks = rows * kv_heads;
    const task_fn task = task_for(groups);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed) if (threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++)
        failed |= task(t / kv_heads, t % kv_heads, groups, dim, vdim, scale, bf16, (const char *)query, q_head_stride,
                       q_offsets, row_seq, row_runs, runs, k_ptrs, v_ptrs, k_head_strides, v_head_strides,
                       (char *)out, heads) != 0;
    return failed ? -1 : 0;
}
