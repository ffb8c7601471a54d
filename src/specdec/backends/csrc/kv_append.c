/* A batched pass's new keys and values, appended to each sequence's own cache slab in one call
   (specdec, Apache-2.0).

   A pass over several sequences computes its keys [kv_heads, rows, dim] for all of their rows at
   once; sequence s's `counts[s]` rows (in order) go to positions starts[s].. of its slab. Done in
   Python, that is four tensor slices and copies per sequence and layer, which at 16 sequences cost
   more than the pass's attention; here it is one call per layer. A copy: no arithmetic. */

#include <stdint.h>
#include <string.h>

/* key, value: the pass's rows, head h's row r at key + h * key_head + r * key_row (bytes; a row's
   k_bytes (v_bytes) contiguous). Sequence s's slab: its head h's position p at
   k_ptrs[s] + h * k_heads[s] * size + p * k_bytes, k_heads[s] in elements of `size` bytes, room for
   capacities[s] positions. Returns 0, or -1 (nothing written) where a sequence's rows do not fit. */
int specdec_append_kv(int64_t seqs, int64_t kv_heads, int64_t size, int64_t k_bytes, int64_t v_bytes,
                      const char *key, int64_t key_head, int64_t key_row,
                      const char *value, int64_t value_head, int64_t value_row,
                      const int64_t *counts, const int64_t *starts, const int64_t *capacities,
                      const int64_t *k_ptrs, const int64_t *v_ptrs, const int64_t *k_heads, const int64_t *v_heads) {
    for (int64_t s = 0; s < seqs; s++)
        if (starts[s] < 0 || counts[s] < 0 || starts[s] + counts[s] > capacities[s]) return -1;
    int64_t first = 0;
    for (int64_t s = 0; s < seqs; s++) {
        char *keys = (char *)(intptr_t)k_ptrs[s], *values = (char *)(intptr_t)v_ptrs[s];
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t r = 0; r < counts[s]; r++) {
                memcpy(keys + h * k_heads[s] * size + (starts[s] + r) * k_bytes,
                       key + h * key_head + (first + r) * key_row, (size_t)k_bytes);
                memcpy(values + h * v_heads[s] * size + (starts[s] + r) * v_bytes,
                       value + h * value_head + (first + r) * value_row, (size_t)v_bytes);
            }
        first += counts[s];
    }
    return 0;
}
