/* Causal prefill attention on the CPU: every query of a step's prefill chunks against its
 * request's keys in the paged cache (earlier chunks and a cached prefix included), softmax in
 * float32, in one call for all chunks of a layer.
 *
 * Cache layout (engine/model/attention.py): cache[block][kv_head][offset][dim], contiguous.
 * Chunk c holds lengths[c] queries, rows token_starts[c] + t of q and out, at positions
 * starts[c] + t; query t sees the keys at positions 0 .. starts[c] + t, which live in blocks
 * block_table[c][p / block_size] at p % block_size (this step's own K/V are written to the
 * cache before attention runs). Query head (kv_head * group + g) reads kv_head.
 *
 * Two phases in one parallel region:
 *   1. each (chunk, kv head)'s keys and values are widened to float32 once into the scratch:
 *      keys transposed in blocks of LANES positions ([dim][LANES] per block, the layout the
 *      score loop reads one vector per dim from), values as rows [position][dim];
 *   2. work items of QUERY_TILE positions of one chunk and kv head (their rows: positions x
 *      the group's query heads) in micro-tiles of MICRO_ROWS rows: scores of the micro-tile's
 *      rows against LANES keys at a time (a broadcast query element times a vector of keys,
 *      summed over dim), kept in the thread's scratch; then the exact softmax (max, exp, sum
 *      per row; keys after a row's position get probability 0); then the output, a vector of
 *      dims at a time, rounded once into out.
 * The vectors are gcc's generic vectors of LANES floats, one register of the build's CPU: 16
 * with AVX-512 (-march=native on such a CPU), 8 elsewhere (AVX2; SSE code takes two halves).
 * head_dim 64 and 128 get loops unrolled for that size, others (multiples of 16, as
 * cpu_prefill_attention.py checks) a generic loop.
 *
 * Built by engine/model/kernels/cpu_prefill_attention.py with gcc -O3 -march=native -fopenmp;
 * that module checks the tables and bounds before any call, and gives the scratch
 * (prefill_scratch_floats() floats).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8 /* one AVX2 register (16 ran 5x slower there: vector.h) */
#endif
#define VECTOR_LANES LANES
#include "bf16.h"
#include "vector.h"

#define MICRO_ROWS 6  /* query rows scored together (4, 8 and 12 were slower here) */
#define QUERY_TILE 32 /* positions per work item */
#define MAX_HEAD_DIM 256
/* Vectors of dims a pass over the values sums per row: the MICRO_ROWS x VALUE_VECTORS sums
 * take most of the vector registers (24 of AVX-512's 32, 12 of AVX2's 16; more spill). */
#define VALUE_VECTORS (LANES == 16 ? 4 : 2)

typedef float vf_loose __attribute__((vector_size(LANES * 4), aligned(4)));

typedef struct {
    const void *q, *key_cache, *value_cache;
    const int64_t *block_table, *token_starts, *starts, *lengths;
    void *out;
    float *scratch;
    int64_t q_stride, out_stride, max_blocks, num_chunks, num_heads, num_kv_heads, head_dim;
    int64_t block_size, num_threads;
    float scale;
    int dtype;
} Args;

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

static inline int64_t num_keys(const Args *a, int64_t chunk) {
    return a->starts[chunk] + a->lengths[chunk];
}

/* Floats of one (chunk, kv head)'s widened keys and values in the scratch. */
static inline int64_t kv_floats(const Args *a, int64_t chunk) {
    const int64_t keys = num_keys(a, chunk);
    return (round_up(keys, LANES) + keys) * a->head_dim;
}

/* Floats of one thread's scores: MICRO_ROWS rows as long as the longest chunk's keys. */
static inline int64_t score_floats(const Args *a) {
    int64_t longest = 0;
    for (int64_t c = 0; c < a->num_chunks; ++c)
        if (num_keys(a, c) > longest) longest = num_keys(a, c);
    return MICRO_ROWS * round_up(longest, LANES);
}

static inline vfloat splat(float x) { return (vfloat){0} + x; }

static inline vfloat load(const float *p) { return *(const vf_loose *)p; }

static inline float lane_max(vfloat v) {
    float m = v[0];
    for (int i = 1; i < LANES; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float lane_sum(vfloat v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; ++i) s += v[i];
    return s;
}

/* lanes where mask is set (all bits) take a, the others b */
/* Phase 1: (chunk, kv head, key block) -> widened keys (transposed) and values. */
static void widen_block(const Args *a, float *kv, int64_t chunk, int64_t kv_head, int64_t block) {
    const int64_t dim = a->head_dim, keys = num_keys(a, chunk);
    float *key_t = kv + block * LANES * dim; /* [dim][LANES] */
    float *values = kv + round_up(keys, LANES) * dim;
    for (int64_t lane = 0; lane < LANES; ++lane) {
        const int64_t p = block * LANES + lane;
        if (p >= keys) {
            for (int64_t d = 0; d < dim; ++d) key_t[d * LANES + lane] = 0.0f;
            continue;
        }
        const int64_t cache_block = a->block_table[chunk * a->max_blocks + p / a->block_size];
        const int64_t row =
            ((cache_block * a->num_kv_heads + kv_head) * a->block_size + p % a->block_size) * dim;
        for (int64_t d = 0; d < dim; ++d) {
            key_t[d * LANES + lane] = load_float(a->key_cache, row + d, a->dtype);
            values[p * dim + d] = load_float(a->value_cache, row + d, a->dtype);
        }
    }
}

/* Phase 2, one micro-tile: MICRO_ROWS query rows (queries [MICRO_ROWS][dim], scaled, in
 * float32), row i at position limits[i] - 1 of the chunk (a row past `rows` has limit 0 and
 * zero queries: computed, never stored); scores [MICRO_ROWS][>= longest limit], the thread's. */
static inline __attribute__((always_inline)) void attend_rows(
    const Args *a, const float *kv, int64_t keys, const float *queries, const int64_t *limits,
    int rows, float *scores, void *const *outs, const int64_t dim) {
    const float *values = kv + round_up(keys, LANES) * dim;
    int64_t longest = 0;
    for (int i = 0; i < MICRO_ROWS; ++i) longest = limits[i] > longest ? limits[i] : longest;
    const int64_t stride = round_up(longest, LANES);
    vint lane_index;
    for (int l = 0; l < LANES; ++l) lane_index[l] = l;
    const vfloat minus_inf = splat(-__builtin_inff());
    vfloat maxima[MICRO_ROWS];
    for (int i = 0; i < MICRO_ROWS; ++i) maxima[i] = minus_inf;
    for (int64_t first = 0; first < longest; first += LANES) { /* scores, masked past limits */
        const float *key_t = kv + first * dim;
        vfloat sums[MICRO_ROWS] = {0};
        for (int64_t d = 0; d < dim; ++d) {
            const vfloat k = load(key_t + d * LANES);
            for (int i = 0; i < MICRO_ROWS; ++i) sums[i] += queries[i * dim + d] * k;
        }
        const vint position = lane_index + (int32_t)first;
        for (int i = 0; i < MICRO_ROWS; ++i) {
            const vfloat s = select_lanes(position < (int32_t)limits[i], sums[i], minus_inf);
            *(vf_loose *)(scores + i * stride + first) = s;
            maxima[i] = select_lanes(s > maxima[i], s, maxima[i]);
        }
    }
    float inverse[MICRO_ROWS];
    for (int i = 0; i < MICRO_ROWS; ++i) { /* probabilities (0 past the limit), their sum */
        const vfloat row_max = splat(lane_max(maxima[i]));
        vfloat total = {0};
        for (int64_t first = 0; first < longest; first += LANES) {
            float *s = scores + i * stride + first;
            const vint position = lane_index + (int32_t)first;
            const vfloat p = select_lanes(position < (int32_t)limits[i],
                                      exp_lanes(load(s) - row_max), splat(0.0f));
            *(vf_loose *)s = p;
            total += p;
        }
        inverse[i] = 1.0f / lane_sum(total);
    }
    for (int64_t part = 0; part < dim; part += VALUE_VECTORS * LANES) {
        const int64_t width =
            dim - part < VALUE_VECTORS * LANES ? (dim - part) / LANES : VALUE_VECTORS;
        vfloat acc[MICRO_ROWS][VALUE_VECTORS] = {{{0}}};
        for (int64_t p = 0; p < longest; ++p) {
            const float *v = values + p * dim + part;
            vfloat vs[VALUE_VECTORS];
            for (int w = 0; w < VALUE_VECTORS; ++w)
                vs[w] = w < width ? load(v + w * LANES) : splat(0.0f);
            for (int i = 0; i < MICRO_ROWS; ++i) {
                const float weight = scores[i * stride + p];
                for (int w = 0; w < VALUE_VECTORS; ++w) acc[i][w] += weight * vs[w];
            }
        }
        for (int i = 0; i < rows; ++i)
            for (int w = 0; w < width; ++w)
                for (int l = 0; l < LANES; ++l)
                    store_float(outs[i], part + w * LANES + l, a->dtype,
                                acc[i][w][l] * inverse[i]);
    }
}

static void attend_rows_any(const Args *a, const float *kv, int64_t keys, const float *queries,
                            const int64_t *limits, int rows, float *scores, void *const *outs) {
    switch (a->head_dim) {
    case 64:
        attend_rows(a, kv, keys, queries, limits, rows, scores, outs, 64);
        break;
    case 128:
        attend_rows(a, kv, keys, queries, limits, rows, scores, outs, 128);
        break;
    default:
        attend_rows(a, kv, keys, queries, limits, rows, scores, outs, a->head_dim);
    }
}

/* Phase 2: the rows of QUERY_TILE positions from `first` of one chunk and kv head. */
static void attend_tile(const Args *a, const float *kv, int64_t chunk, int64_t kv_head,
                        int64_t first, float *scores) {
    const int64_t dim = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t length = a->lengths[chunk], start = a->starts[chunk];
    const int64_t end = first + QUERY_TILE < length ? first + QUERY_TILE : length;
    const int64_t num_rows = (end - first) * group;
    float queries[MICRO_ROWS * MAX_HEAD_DIM];
    int64_t limits[MICRO_ROWS];
    void *outs[MICRO_ROWS];
    const int64_t out_size = a->dtype == DTYPE_BF16 ? 2 : 4;
    for (int64_t row = 0; row < num_rows; row += MICRO_ROWS) {
        const int rows = num_rows - row < MICRO_ROWS ? (int)(num_rows - row) : MICRO_ROWS;
        for (int i = 0; i < rows; ++i) {
            const int64_t t = first + (row + i) / group;
            const int64_t head = kv_head * group + (row + i) % group;
            const int64_t token = a->token_starts[chunk] + t;
            const int64_t q_index = token * a->q_stride + head * dim;
            for (int64_t d = 0; d < dim; ++d)
                queries[i * dim + d] = load_float(a->q, q_index + d, a->dtype) * a->scale;
            limits[i] = start + t + 1;
            outs[i] = (char *)a->out + (token * a->out_stride + head * dim) * out_size;
        }
        for (int i = rows; i < MICRO_ROWS; ++i) {
            memset(queries + i * dim, 0, dim * sizeof(float));
            limits[i] = 0;
        }
        attend_rows_any(a, kv, num_keys(a, chunk), queries, limits, rows, scores, outs);
    }
}

int64_t prefill_scratch_floats(const int64_t *starts, const int64_t *lengths, int64_t num_chunks,
                               int64_t num_kv_heads, int64_t head_dim, int64_t num_threads) {
    Args a = {.starts = starts, .lengths = lengths, .num_chunks = num_chunks,
              .num_kv_heads = num_kv_heads, .head_dim = head_dim};
    int64_t total = 0;
    for (int64_t c = 0; c < num_chunks; ++c) total += num_kv_heads * kv_floats(&a, c);
    return total + num_threads * score_floats(&a);
}

void prefill_attention(const void *q, int64_t q_stride, const void *key_cache,
                       const void *value_cache, const int64_t *block_table, int64_t max_blocks,
                       const int64_t *token_starts, const int64_t *starts,
                       const int64_t *lengths, int64_t num_chunks, void *out, int64_t out_stride,
                       float *scratch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, int dtype, int num_threads) {
    const Args a = {q, key_cache, value_cache, block_table, token_starts, starts, lengths, out,
                    scratch, q_stride, out_stride, max_blocks, num_chunks, num_heads,
                    num_kv_heads, head_dim, block_size, num_threads, scale, dtype};
    /* where each chunk's (kv head 0) widened keys and values start; then the scores */
    int64_t kv_offsets[num_chunks + 1], key_blocks[num_chunks + 1], tiles[num_chunks + 1];
    kv_offsets[0] = key_blocks[0] = tiles[0] = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        kv_offsets[c + 1] = kv_offsets[c] + num_kv_heads * kv_floats(&a, c);
        key_blocks[c + 1] = key_blocks[c] + num_kv_heads * round_up(num_keys(&a, c), LANES) / LANES;
        tiles[c + 1] = tiles[c] + num_kv_heads * round_up(lengths[c], QUERY_TILE) / QUERY_TILE;
    }
    float *const all_scores = scratch + kv_offsets[num_chunks];
    const int64_t per_thread = score_floats(&a);
#pragma omp parallel num_threads(num_threads)
    {
        int64_t c = 0;
#pragma omp for schedule(static)
        for (int64_t index = 0; index < key_blocks[num_chunks]; ++index) {
            while (index >= key_blocks[c + 1]) ++c;
            const int64_t blocks = round_up(num_keys(&a, c), LANES) / LANES;
            const int64_t local = index - key_blocks[c];
            const int64_t kv_head = local / blocks;
            widen_block(&a, scratch + kv_offsets[c] + kv_head * kv_floats(&a, c), c, kv_head,
                        local % blocks);
        }
        float *scores = all_scores + omp_get_thread_num() * per_thread;
        int64_t chunk = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t index = 0; index < tiles[num_chunks]; ++index) {
            while (index >= tiles[chunk + 1]) ++chunk;
            const int64_t per_head = round_up(lengths[chunk], QUERY_TILE) / QUERY_TILE;
            const int64_t local = index - tiles[chunk];
            const int64_t kv_head = local / per_head;
            attend_tile(&a, scratch + kv_offsets[chunk] + kv_head * kv_floats(&a, chunk), chunk,
                        kv_head, local % per_head * QUERY_TILE, scores);
        }
    }
}
