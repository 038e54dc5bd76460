/* Rotary embedding of a step's queries and keys, and the store of its keys and values into
 * the paged cache, in one pass (what engine/model/rope.py's apply_rope and attention's
 * index_put stores do in about a dozen torch ops a layer).
 *
 * Per token t (rows of q_src, k_src and v_src, each with its own stride in elements, heads
 * of head_dim contiguous inside a row):
 *   q_out[t][h]                       = rope(q_src[t][h])       h < num_heads
 *   key_cache[slot of t][kv_head]     = rope(k_src[t][kv_head]) kv_head < num_kv_heads
 *   value_cache[slot of t][kv_head]   = v_src[t][kv_head]
 * where the slot of t is block slot_blocks[t], offset slot_offsets[t] (cache layout
 * [block][kv_head][offset][dim], contiguous), and rope is the rotate-half rotation with the
 * step's cos = [cos | cos] and signed sin = [-sin | sin] rows (t's row of each, head_dim
 * long): y[d] = x[d] cos[d] + x[d +- head_dim / 2] sin[d]. Rounded as torch rounds apply_rope's
 * two ops: x cos to the dtype first, then the sum (in bf16 two roundings; in float32 only
 * the order of the float32 operations can differ).
 *
 * Built by engine/model/kernels/cpu_rope_store.py with gcc -O3 -march=native -fopenmp; the
 * slots are checked there once per step before any call.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256

static inline float round_to_dtype(float value, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_float(float_to_bf16(value)) : value;
}

/* One head: y = rope(x) with the token's cos and sin rows, widened once per token. The
 * head is widened into float32, rotated, then narrowed: three plain loops that gcc
 * vectorizes (a loop reading both dtypes at once, element by element, ran 4x slower). */
static inline __attribute__((always_inline)) void widen(const void *restrict x,
                                                        float *restrict out, int64_t n,
                                                        const int dtype) {
    for (int64_t d = 0; d < n; ++d) out[d] = load_float(x, d, dtype);
}

static inline __attribute__((always_inline)) void rotate(const void *restrict x,
                                                         const float *restrict cos,
                                                         const float *restrict sin,
                                                         void *restrict y, int64_t head_dim,
                                                         const int dtype) {
    const int64_t half = head_dim / 2;
    float xs[MAX_HEAD_DIM], ys[MAX_HEAD_DIM];
    widen(x, xs, head_dim, dtype);
    for (int64_t d = 0; d < half; ++d)
        ys[d] = round_to_dtype(xs[d] * cos[d], dtype) + xs[d + half] * sin[d];
    for (int64_t d = half; d < head_dim; ++d)
        ys[d] = round_to_dtype(xs[d] * cos[d], dtype) + xs[d - half] * sin[d];
    for (int64_t d = 0; d < head_dim; ++d) store_float(y, d, dtype, ys[d]);
}

typedef struct {
    const char *q_src, *k_src, *v_src, *cos, *sin;
    char *q_out, *key_cache, *value_cache;
    const int64_t *slot_blocks, *slot_offsets;
    int64_t q_stride, k_stride, v_stride, num_tokens, num_heads, num_kv_heads, head_dim;
    int64_t block_size;
} Args;

/* Every token, with `dtype` and `dim` constants after inlining: loops specialized per dtype
 * and common head_dim. */
static inline __attribute__((always_inline)) void all_tokens(const Args *a, int num_threads,
                                                             const int dtype, const int64_t dim) {
    const int64_t size = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (a->num_tokens > 16)
    for (int64_t t = 0; t < a->num_tokens; ++t) {
        float cos[MAX_HEAD_DIM], sin[MAX_HEAD_DIM];
        widen(a->cos + t * dim * size, cos, dim, dtype);
        widen(a->sin + t * dim * size, sin, dim, dtype);
        for (int64_t h = 0; h < a->num_heads; ++h)
            rotate(a->q_src + (t * a->q_stride + h * dim) * size, cos, sin,
                   a->q_out + (t * a->num_heads + h) * dim * size, dim, dtype);
        for (int64_t h = 0; h < a->num_kv_heads; ++h) {
            const int64_t slot =
                ((a->slot_blocks[t] * a->num_kv_heads + h) * a->block_size + a->slot_offsets[t]) *
                dim * size;
            rotate(a->k_src + (t * a->k_stride + h * dim) * size, cos, sin, a->key_cache + slot,
                   dim, dtype);
            memcpy(a->value_cache + slot, a->v_src + (t * a->v_stride + h * dim) * size,
                   dim * size);
        }
    }
}

/* all_tokens with `dtype` (a constant here) and the common head_dims as constants. */
static inline __attribute__((always_inline)) void by_head_dim(const Args *a, int num_threads,
                                                              const int dtype) {
    if (a->head_dim == 64)
        all_tokens(a, num_threads, dtype, 64);
    else if (a->head_dim == 128)
        all_tokens(a, num_threads, dtype, 128);
    else
        all_tokens(a, num_threads, dtype, a->head_dim);
}

void rope_store(const void *q_src, int64_t q_stride, const void *k_src, int64_t k_stride,
                const void *v_src, int64_t v_stride, const void *cos, const void *sin,
                void *q_out, void *key_cache, void *value_cache, const int64_t *slot_blocks,
                const int64_t *slot_offsets, int64_t num_tokens, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int dtype,
                int num_threads) {
    const Args a = {q_src,       k_src,       v_src,      cos,          sin,
                    q_out,       key_cache,   value_cache, slot_blocks, slot_offsets,
                    q_stride,    k_stride,    v_stride,   num_tokens,   num_heads,
                    num_kv_heads, head_dim,   block_size};
    if (dtype == DTYPE_BF16)
        by_head_dim(&a, num_threads, DTYPE_BF16);
    else
        by_head_dim(&a, num_threads, DTYPE_F32);
}
