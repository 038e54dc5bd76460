/* Paged decode attention on the CPU: one query token per sequence, keys and values read in
 * place from the block cache (no gather copy), online softmax in float32.
 *
 * Cache layout (engine/model/attention.py): cache[block][kv_head][offset][dim], contiguous.
 * Position p of sequence b lives in block block_table[b][p / block_size] at p % block_size.
 * Query head (kv_head * group + g) reads kv_head. Work items are (sequence, kv_head) pairs,
 * split across OpenMP threads. An item visits its sequence's blocks once: it widens the
 * block's keys to float32 transposed ([dim][offset], so the scores of all offsets come from
 * one vector multiply-add per dim) and its values to float32, then folds them into the
 * group's running max, sum and output (online softmax), all in float32.
 *
 * Built by engine/model/kernels/cpu_paged_decode.py with gcc -O3 -march=native -fopenmp; the
 * bounds below are checked there before any call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_float(uint16_t bits) {
    uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if (isnan(value)) return 0x7FC0;
    bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* count elements starting at element `offset` of src, widened to float32. */
static void widen(const void *src, int dtype, int64_t offset, int64_t count, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *in = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < count; ++i) dst[i] = bf16_to_float(in[i]);
    } else {
        memcpy(dst, (const float *)src + offset, count * sizeof(float));
    }
}

static void narrow(const float *src, int64_t count, int dtype, void *dst, int64_t offset) {
    if (dtype == DTYPE_BF16) {
        uint16_t *out = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)dst + offset, src, count * sizeof(float));
    }
}

typedef struct {
    int64_t group, head_dim, block_size, num_kv_heads;
    int dtype;
    float scale;
} Shape;

/* The group's scores against n cached positions: scores[g][o] = query[g] . key[o]. */
static void block_scores(const Shape *s, const float query[][MAX_HEAD_DIM],
                         const float *keys_t, int64_t n, float scores[][MAX_BLOCK_SIZE]) {
    for (int64_t g = 0; g < s->group; ++g) {
        float *row = scores[g];
        for (int64_t o = 0; o < n; ++o) row[o] = 0.0f;
        for (int64_t d = 0; d < s->head_dim; ++d) {
            const float q = query[g][d];
            const float *k = keys_t + d * s->block_size;
            for (int64_t o = 0; o < n; ++o) row[o] += q * k[o];
        }
    }
}

/* One (sequence, kv_head) item. Always inlined so that the common shapes below get loops
 * with constant trip counts (fully vectorized). */
static inline __attribute__((always_inline)) void attend_shaped(
    const Shape *s, const void *q, const void *key_cache, const void *value_cache,
    const int64_t *blocks, int64_t seq_len, void *out, int64_t q_offset, int64_t out_offset,
    int64_t kv_head, const int64_t head_dim, const int64_t block_size) {
    float query[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float scores[MAX_GROUP][MAX_BLOCK_SIZE];
    float keys_t[MAX_HEAD_DIM * MAX_BLOCK_SIZE], values[MAX_BLOCK_SIZE * MAX_HEAD_DIM];
    float row[MAX_BLOCK_SIZE * MAX_HEAD_DIM];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int64_t g = 0; g < s->group; ++g) {
        widen(q, s->dtype, q_offset + (kv_head * s->group + g) * head_dim, head_dim, query[g]);
        for (int64_t d = 0; d < head_dim; ++d) {
            query[g][d] *= s->scale;
            acc[g][d] = 0.0f;
        }
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    const int64_t block_elems = block_size * head_dim;
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t base = (blocks[j] * s->num_kv_heads + kv_head) * block_elems;
        int64_t n = seq_len - j * block_size;
        if (n > block_size) n = block_size;
        widen(key_cache, s->dtype, base, n * head_dim, row);
        for (int64_t i = n * head_dim; i < block_size * head_dim; ++i) row[i] = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d)
            for (int64_t o = 0; o < block_size; ++o) keys_t[d * block_size + o] = row[o * head_dim + d];
        widen(value_cache, s->dtype, base, n * head_dim, values);
        for (int64_t g = 0; g < s->group; ++g) {
            float *out_row = scores[g];
            for (int64_t o = 0; o < block_size; ++o) out_row[o] = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) {
                const float qd = query[g][d];
                const float *k = keys_t + d * block_size;
                for (int64_t o = 0; o < block_size; ++o) out_row[o] += qd * k[o];
            }
        }
        for (int64_t g = 0; g < s->group; ++g) {
            float *probs = scores[g];
            float block_max = probs[0];
            for (int64_t o = 1; o < n; ++o) block_max = block_max > probs[o] ? block_max : probs[o];
            const float new_max = running_max[g] > block_max ? running_max[g] : block_max;
            const float correction = expf(running_max[g] - new_max);
            float block_sum = 0.0f;
            for (int64_t o = 0; o < n; ++o) {
                probs[o] = expf(probs[o] - new_max);
                block_sum += probs[o];
            }
            running_sum[g] = running_sum[g] * correction + block_sum;
            running_max[g] = new_max;
            for (int64_t d = 0; d < head_dim; ++d) acc[g][d] *= correction;
        }
        for (int64_t o = 0; o < n; ++o) {
            const float *restrict v = values + o * head_dim;
            for (int64_t g = 0; g < s->group; ++g) {
                const float p = scores[g][o];
                float *restrict a = acc[g];
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
            }
        }
    }
    for (int64_t g = 0; g < s->group; ++g) {
        const float inverse_sum = 1.0f / running_sum[g];
        for (int64_t d = 0; d < head_dim; ++d) acc[g][d] *= inverse_sum;
        narrow(acc[g], head_dim, s->dtype, out, out_offset + (kv_head * s->group + g) * head_dim);
    }
}

static void attend(const Shape *s, const void *q, const void *key_cache,
                   const void *value_cache, const int64_t *blocks, int64_t seq_len, void *out,
                   int64_t q_offset, int64_t out_offset, int64_t kv_head) {
    if (s->head_dim == 64 && s->block_size == 16)
        attend_shaped(s, q, key_cache, value_cache, blocks, seq_len, out, q_offset, out_offset,
                      kv_head, 64, 16);
    else
        attend_shaped(s, q, key_cache, value_cache, blocks, seq_len, out, q_offset, out_offset,
                      kv_head, s->head_dim, s->block_size);
}

/* q [num_seqs, num_heads, head_dim] with q_stride elements between sequences; out likewise
 * with out_stride; block_table [num_seqs, max_blocks]; every seq_lens[b] >= 1 and covered by
 * its table row. dtype: 0 float32, 1 bfloat16 (q, caches and out alike). */
void paged_decode(const void *q, int64_t q_stride, const void *key_cache,
                  const void *value_cache, const int64_t *block_table, int64_t max_blocks,
                  const int64_t *seq_lens, void *out, int64_t out_stride, int64_t num_seqs,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, float scale, int dtype, int num_threads) {
    const Shape shape = {num_heads / num_kv_heads, head_dim, block_size, num_kv_heads, dtype,
                         scale};
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
        const int64_t b = item / num_kv_heads;
        attend(&shape, q, key_cache, value_cache, block_table + b * max_blocks, seq_lens[b],
               out, b * q_stride, b * out_stride, item % num_kv_heads);
    }
}
