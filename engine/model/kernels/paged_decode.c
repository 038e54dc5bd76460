/* Paged decode attention on the CPU: one query token per sequence, keys and values read in
 * place from the block cache (no gather copy), online softmax in float32.
 *
 * Cache layout (engine/model/attention.py): cache[block][kv_head][offset][dim], contiguous.
 * Position p of sequence b lives in block block_table[b][p / block_size] at p % block_size.
 * Query head (kv_head * group + g) reads kv_head.
 *
 * Work items are whole sequences: block by block, and the kv heads inside a block, which lie
 * next to each other, so a run of consecutive block ids is read as one stream that the
 * hardware prefetcher follows (a pure read of the blocks took half the time in this order
 * than head by head). With fewer than 4 sequences per thread, items are single kv heads.
 * Each thread takes one contiguous run of items holding about the same number of blocks, so
 * it knows which blocks come next and prefetches them PREFETCH_AHEAD blocks early, spread over
 * the value loop, into the level PREFETCH_LOCALITY names: L2 (prefetcht2) by default, as on an
 * Intel Xeon prefetching into L1 (prefetcht0) stalled on its few miss buffers and was slower
 * than no software prefetch at all; L1 on AMD CPUs with AVX-512, where it was faster.
 *
 * Each (block, kv head) is walked in chunks of up to 16 positions (AVX-512 path):
 *   scores  for each query head g, 16 partial-sum vectors (one per position, from dot products
 *           along dim: vdpbf16ps on bf16 pairs, or fma on float32), then one transpose-add
 *           tree turns them into a vector whose lane o is the score of position o;
 *   softmax online: the chunk's max updates the head's running max, the older sum and output
 *           are rescaled by exp(old_max - new_max);
 *   values  out[g] += p[g][o] * v[o] with the output kept in registers across the chunk.
 * With AVX2 + FMA but no AVX-512 the same scheme runs on 8-lane vectors (head_dim a multiple
 * of 8), one query head at a time through scores, softmax and values, in steps of up to 16
 * positions (two vectors of scores: half the horizontal max, sum and rescaling per position
 * of 8-position steps): scores by fma on float32 (bf16 rows widened by a 16-bit left shift),
 * dims as the outer loop so the 8 positions' sums are independent fma chains, a transpose-add
 * by hadd, an exp without scalef (2^n built in the exponent bits), and values in passes of
 * 64 dims held in registers (each query head reloads them from L1: one load per fma either
 * way, where several heads' outputs at once spilled out of AVX2's 16 registers). Otherwise
 * (no vector path, head_dim not a multiple of the lane count, or built with
 * -DPAGED_DECODE_PORTABLE) a portable loop does the same one position at a time.
 *
 * Built by engine/model/kernels/cpu_paged_decode.py with gcc -O3 -march=native -fopenmp; the
 * bounds below are checked there before any call.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* VECTOR_PATH: 1 the AVX-512 path, 2 the AVX2 + FMA path, 0 only the portable loop. */
#if defined(__AVX512F__) && !defined(PAGED_DECODE_PORTABLE)
#define VECTOR_PATH 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && !defined(PAGED_DECODE_PORTABLE)
#define VECTOR_PATH 2
#include <immintrin.h>
#else
#define VECTOR_PATH 0
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_ITEM_HEADS 32 /* at most this many query heads per work item */
#define CHUNK 16          /* positions scored together: one 16-lane vector per query head */
#define PREFETCH_AHEAD 4  /* blocks between the one read and the one prefetched */
/* Where prefetched rows go, chosen per CPU kind by cpu_build.py (prefetch_flags): 1 = L2 only
 * (prefetcht2, the default: on an Intel Xeon prefetching into L1 stalled on its few miss
 * buffers), 3 = L1 (prefetcht0: 15-20% faster in bf16, 5-8% in float32, on an AMD EPYC with
 * AVX-512). */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 1
#endif

typedef struct {
    const void *q, *key_cache, *value_cache;
    const int64_t *block_table, *seq_lens;
    void *out;
    int64_t q_stride, out_stride, max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    int64_t num_seqs, element_size;
    int64_t kv_heads_per_item, items_per_seq; /* an item: a run of a sequence's kv heads */
    float scale;
    int dtype;
} Args;

typedef struct {
    int64_t seq, first_kv_head, num_kv_heads;
} Item;

static inline Item item_of(const Args *a, int64_t index) {
    const int64_t first = index % a->items_per_seq * a->kv_heads_per_item;
    const int64_t left = a->num_kv_heads - first;
    return (Item){index / a->items_per_seq, first,
                  left < a->kv_heads_per_item ? left : a->kv_heads_per_item};
}

static inline int64_t num_blocks_of(const Args *a, int64_t seq) {
    return (a->seq_lens[seq] + a->block_size - 1) / a->block_size;
}

/* Element index of (block, kv_head, offset 0, dim 0) in either cache. */
static inline int64_t block_base(const Args *a, int64_t block, int64_t kv_head) {
    return (block * a->num_kv_heads + kv_head) * a->block_size * a->head_dim;
}

/* What to prefetch: the element index of the item's local kv head h in its block j (past the
 * end: in the next item of this thread's run, its own head h), or -1 when there is none. */
static int64_t future_block(const Args *a, int64_t index, int64_t end_index, int64_t j,
                            int64_t h) {
    Item item = item_of(a, index);
    const int64_t blocks = num_blocks_of(a, item.seq);
    if (j >= blocks) {
        if (index + 1 >= end_index) return -1;
        j -= blocks;
        item = item_of(a, index + 1);
        if (j >= num_blocks_of(a, item.seq) || h >= item.num_kv_heads) return -1;
    }
    return block_base(a, a->block_table[item.seq * a->max_blocks + j], item.first_kv_head + h);
}

/* Ask for `count` key and value rows from element index `start` on into the cache level
 * PREFETCH_LOCALITY says (nothing when start < 0). */
static inline void prefetch_rows(const Args *a, int64_t start, int64_t count) {
    if (start < 0) return;
    const int64_t bytes = count * a->head_dim * a->element_size;
    const char *keys = (const char *)a->key_cache + start * a->element_size;
    const char *values = (const char *)a->value_cache + start * a->element_size;
    for (int64_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(keys + line, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(values + line, 0, PREFETCH_LOCALITY);
    }
}

#if VECTOR_PATH == 1

static inline __m512 load16(const void *base, int64_t index, const int dtype) {
    if (dtype == DTYPE_BF16) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

/* lane i of the result = sum of the 16 lanes of rows[i]: a transpose-add tree (45 ops). */
static inline __m512 sum_rows(const __m512 rows[CHUNK]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i) /* 128-bit lanes: [r2i r2i+1 r2i r2i+1] partial sums */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]),
                                 _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* 128-bit lanes: [r4i .. r4i+3] partial sums */
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i) /* fold the four 128-bit lanes pairwise */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* e^x for x <= 0 in float32 (Cephes' expf): x = n ln2 + r with |r| <= ln2/2, e^r by a
 * degree-6 polynomial, then scaled by 2^n; x below -104 gives 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below: 0 after scaling */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#ifdef __AVX512BF16__
#define HAVE_PAIRS 1 /* vdpbf16ps: float32 sums of bf16 pair products */
#else
#define HAVE_PAIRS 0
#endif

/* Lane o: the unscaled score q . key[o] for rows o < count <= 16 (0 for later rows). `pairs`:
 * bf16 keys and query, head_dim % 32 == 0, vdpbf16ps; else float32 fma on widened keys. Each
 * row gives a vector of 16 partial sums; sum_rows adds each one up into its lane. */
static inline __attribute__((always_inline)) __m512 chunk_scores(
    const void *keys, int64_t base, int64_t count, const float *query, const uint16_t *query_bf16,
    const int dtype, const int64_t head_dim, const int pairs) {
    __m512 rows[CHUNK];
    for (int64_t o = 0; o < CHUNK; ++o) {
        __m512 sum = _mm512_setzero_ps();
        if (o < count) {
            const int64_t row = base + o * head_dim;
#if HAVE_PAIRS
            if (pairs) {
                const uint16_t *k = (const uint16_t *)keys + row;
                for (int64_t d = 0; d < head_dim; d += 32)
                    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(k + d),
                                           (__m512bh)_mm512_loadu_si512(query_bf16 + d));
            }
#endif
            if (!pairs)
                for (int64_t d = 0; d < head_dim; d += 16)
                    sum = _mm512_fmadd_ps(load16(keys, row + d, dtype), _mm512_loadu_ps(query + d),
                                          sum);
        }
        rows[o] = sum;
    }
    return sum_rows(rows);
}

/* Scores -> probabilities against the head's updated running max (masked lanes 0); returns
 * the factor by which the head's earlier output and sum must be scaled (1 when the max held). */
static inline float softmax_step(__m512 scores, __mmask16 valid, float *running_max,
                                 float *running_sum, __m512 *probs) {
    const float chunk_max = _mm512_mask_reduce_max_ps(valid, scores);
    float correction = 1.0f;
    if (chunk_max > *running_max) {
        correction = expf(*running_max - chunk_max);
        *running_max = chunk_max;
    }
    *probs = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(*running_max))));
    *running_sum = *running_sum * correction + _mm512_reduce_add_ps(*probs);
    return correction;
}

/* out[g] += p[g][o] * value[o] for o < n, float32 fma on widened values. acc[g] holds dims in
 * order. Passes of `width` 16-dim vectors keep group * width accumulators in registers. Row o
 * of `future` (an element index, or -1) is prefetched along the way. */
static inline __attribute__((always_inline)) void accumulate_values(
    const Args *a, int64_t base, int64_t n, float probs[][CHUNK], const float *correction,
    float acc[][MAX_HEAD_DIM], int64_t future, const int dtype, const int64_t group,
    const int64_t head_dim) {
    const void *values = a->value_cache;
    const int64_t width = group <= 4 ? 4 : 2;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * width) {
        const int64_t num_vectors = (head_dim - d0) / 16 < width ? (head_dim - d0) / 16 : width;
        __m512 out[MAX_GROUP][4];
        for (int64_t g = 0; g < group; ++g)
            for (int64_t w = 0; w < num_vectors; ++w)
                out[g][w] = _mm512_mul_ps(_mm512_load_ps(&acc[g][d0 + 16 * w]),
                                          _mm512_set1_ps(correction[g]));
        for (int64_t o = 0; o < n; ++o) {
            if (d0 == 0) prefetch_rows(a, future < 0 ? -1 : future + o * head_dim, 1);
            for (int64_t w = 0; w < num_vectors; ++w) {
                const __m512 v = load16(values, base + o * head_dim + d0 + 16 * w, dtype);
                for (int64_t g = 0; g < group; ++g)
                    out[g][w] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][o]), v, out[g][w]);
            }
        }
        for (int64_t g = 0; g < group; ++g)
            for (int64_t w = 0; w < num_vectors; ++w)
                _mm512_store_ps(&acc[g][d0 + 16 * w], out[g][w]);
    }
}

#if HAVE_PAIRS
/* The bf16 form of accumulate_values: rows o and o+1 interleaved into bf16 pairs (unpack of
 * 16-bit words), weighted by the pair (p[o], p[o+1]) in one vdpbf16ps. The unpack works inside
 * 128-bit lanes, so each 32-dim segment's two accumulators hold dims out of order:
 *   lo[4L + j] = dim 8L + j,  hi[4L + j] = dim 8L + 4 + j   (L < 4, j < 4)
 * acc[g] keeps that order (lo then hi per segment); unpair_dims restores it at the end. */
static inline __attribute__((always_inline)) void accumulate_value_pairs(
    const Args *a, int64_t base, int64_t n, uint16_t probs[][CHUNK], const float *correction,
    float acc[][MAX_HEAD_DIM], int64_t future, const int64_t group, const int64_t head_dim) {
    const void *values = a->value_cache;
    const int64_t width = group <= 4 ? 2 : 1; /* 32-dim segments per pass */
    const uint16_t *rows = (const uint16_t *)values + base;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32 * width) {
        const int64_t num_segments = (head_dim - d0) / 32 < width ? (head_dim - d0) / 32 : width;
        __m512 out[MAX_GROUP][4];
        for (int64_t g = 0; g < group; ++g)
            for (int64_t w = 0; w < 2 * num_segments; ++w)
                out[g][w] = _mm512_mul_ps(_mm512_load_ps(&acc[g][d0 + 16 * w]),
                                          _mm512_set1_ps(correction[g]));
        for (int64_t o = 0; o < n; o += 2) {
            if (d0 == 0) prefetch_rows(a, future < 0 ? -1 : future + o * head_dim, 2);
            __m512i weights[MAX_GROUP];
            for (int64_t g = 0; g < group; ++g) {
                uint32_t pair;
                memcpy(&pair, &probs[g][o], sizeof pair); /* p[o] low, p[o + 1] high */
                weights[g] = _mm512_set1_epi32((int)pair);
            }
            for (int64_t w = 0; w < num_segments; ++w) {
                const int64_t d = d0 + 32 * w;
                const __m512i x = _mm512_loadu_si512(rows + o * head_dim + d);
                const __m512i y = o + 1 < n ? _mm512_loadu_si512(rows + (o + 1) * head_dim + d)
                                            : _mm512_setzero_si512();
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
                for (int64_t g = 0; g < group; ++g) {
                    out[g][2 * w] = _mm512_dpbf16_ps(out[g][2 * w], lo, (__m512bh)weights[g]);
                    out[g][2 * w + 1] = _mm512_dpbf16_ps(out[g][2 * w + 1], hi,
                                                         (__m512bh)weights[g]);
                }
            }
        }
        for (int64_t g = 0; g < group; ++g)
            for (int64_t w = 0; w < 2 * num_segments; ++w)
                _mm512_store_ps(&acc[g][d0 + 16 * w], out[g][w]);
    }
}
#endif

/* Undo accumulate_value_pairs' order: segment [lo | hi] -> dims in order. */
static void unpair_dims(float *acc, int64_t head_dim) {
    float segment[32];
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
        for (int lane = 0; lane < 4; ++lane)
            for (int j = 0; j < 4; ++j) {
                segment[8 * lane + j] = acc[d0 + 4 * lane + j];
                segment[8 * lane + 4 + j] = acc[d0 + 16 + 4 * lane + j];
            }
        memcpy(acc + d0, segment, sizeof segment);
    }
}

/* One item: a run of kv heads of one sequence, block by block and head by head inside a
 * block (consecutive memory). Inlined with constant dtype, group and head_dim for the common
 * shapes so the loops unroll and the output accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_item(
    const Args *a, int64_t index, int64_t end_index, const int dtype, const int64_t group,
    const int64_t head_dim) {
    const int pairs = HAVE_PAIRS && dtype == DTYPE_BF16 && head_dim % 32 == 0;
    const Item item = item_of(a, index);
    const int64_t num_heads = item.num_kv_heads * group; /* query heads, local index h * G + g */
    const int64_t seq_len = a->seq_lens[item.seq], block_size = a->block_size;
    const int64_t *blocks = a->block_table + item.seq * a->max_blocks;
    const int64_t q_base = item.seq * a->q_stride + item.first_kv_head * group * head_dim;
    const uint16_t *query_bf16 = (const uint16_t *)a->q + q_base; /* read only when pairs */
    float query[MAX_ITEM_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[MAX_ITEM_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float probs[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    uint16_t probs_bf16[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    float running_max[MAX_ITEM_HEADS], running_sum[MAX_ITEM_HEADS], correction[MAX_GROUP];
    for (int64_t i = 0; i < num_heads; ++i) {
        for (int64_t d = 0; d < head_dim; ++d) {
            query[i][d] = load_float(a->q, q_base + i * head_dim + d, dtype);
            acc[i][d] = 0.0f;
        }
        running_max[i] = -INFINITY;
        running_sum[i] = 0.0f;
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t in_block = seq_len - j * block_size < block_size ? seq_len - j * block_size
                                                                       : block_size;
        for (int64_t h = 0; h < item.num_kv_heads; ++h) {
            const int64_t future = future_block(a, index, end_index, j + PREFETCH_AHEAD, h);
            const int64_t block_start = block_base(a, blocks[j], item.first_kv_head + h);
            for (int64_t start = 0; start < in_block; start += CHUNK) {
                const int64_t n = in_block - start < CHUNK ? in_block - start : CHUNK;
                const int64_t base = block_start + start * head_dim;
                const __mmask16 valid = (__mmask16)((1u << n) - 1u);
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = h * group + g;
                    const uint16_t *q_bf16 = query_bf16 + i * head_dim;
                    const __m512 s = _mm512_mul_ps(
                        n == CHUNK ? chunk_scores(a->key_cache, base, CHUNK, query[i], q_bf16,
                                                  dtype, head_dim, pairs)
                                   : chunk_scores(a->key_cache, base, n, query[i], q_bf16, dtype,
                                                  head_dim, pairs),
                        scale);
                    __m512 p;
                    correction[g] = softmax_step(s, valid, &running_max[i], &running_sum[i], &p);
#if HAVE_PAIRS
                    if (pairs) {
                        _mm256_store_si256((__m256i *)probs_bf16[g],
                                           (__m256i)_mm512_cvtneps_pbh(p));
                        continue;
                    }
#endif
                    _mm512_store_ps(probs[g], p);
                }
                const int64_t future_rows = future < 0 ? -1 : future + start * head_dim;
#if HAVE_PAIRS
                if (pairs) {
                    accumulate_value_pairs(a, base, n, probs_bf16, correction, &acc[h * group],
                                           future_rows, group, head_dim);
                    continue;
                }
#endif
                accumulate_values(a, base, n, probs, correction, &acc[h * group], future_rows,
                                  dtype, group, head_dim);
            }
        }
    }
    const int64_t out_base = item.seq * a->out_stride + item.first_kv_head * group * head_dim;
    for (int64_t i = 0; i < num_heads; ++i) {
        if (pairs) unpair_dims(acc[i], head_dim);
        const float inverse_sum = 1.0f / running_sum[i];
        for (int64_t d = 0; d < head_dim; ++d)
            store_float(a->out, out_base + i * head_dim + d, dtype, acc[i][d] * inverse_sum);
    }
}

#define SHAPE(DTYPE, GROUP, DIM)                                               \
    if (a->dtype == DTYPE && group == GROUP && a->head_dim == DIM) {           \
        attend_item(a, item, end_item, DTYPE, GROUP, DIM);                     \
        return;                                                                \
    }
#define SHAPES(DTYPE)                                                          \
    SHAPE(DTYPE, 1, 64) SHAPE(DTYPE, 2, 64) SHAPE(DTYPE, 3, 64) SHAPE(DTYPE, 4, 64)  \
    SHAPE(DTYPE, 8, 64) SHAPE(DTYPE, 1, 128) SHAPE(DTYPE, 2, 128) SHAPE(DTYPE, 4, 128) \
    SHAPE(DTYPE, 8, 128)

static void attend_vector(const Args *a, int64_t item, int64_t end_item) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    SHAPES(DTYPE_BF16)
    SHAPES(DTYPE_F32)
    if (a->dtype == DTYPE_BF16)
        attend_item(a, item, end_item, DTYPE_BF16, group, a->head_dim);
    else
        attend_item(a, item, end_item, DTYPE_F32, group, a->head_dim);
}

#endif /* VECTOR_PATH == 1 */

#if VECTOR_PATH == 2
/* The AVX2 + FMA path: the AVX-512 path's scheme on 8-lane vectors, without bf16 pair
 * instructions (bf16 rows are widened to float32) and with 16 vector registers instead of 32,
 * so one query head's output is accumulated at a time. */

#define CHUNK8 8 /* positions scored together: one 8-lane vector per query head */
#define STEP8 16 /* positions per softmax step: two such vectors */

/* 8 elements from base[index] on as float32 (bf16: the 16 bits are the float's top half). */
static inline __m256 load8(const void *base, int64_t index, const int dtype) {
    if (dtype == DTYPE_BF16) {
        const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
    return _mm256_loadu_ps((const float *)base + index);
}

/* lane i of the result = sum of the 8 lanes of rows[i]. hadd works inside 128-bit lanes:
 * after two rounds the low half of `low` holds rows 0-3's sums over lanes 0-3 and its high
 * half their sums over lanes 4-7 (likewise `high` for rows 4-7); one cross-lane add ends it. */
static inline __m256 sum_rows8(const __m256 rows[CHUNK8]) {
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(rows[0], rows[1]),
                                      _mm256_hadd_ps(rows[2], rows[3]));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(rows[4], rows[5]),
                                       _mm256_hadd_ps(rows[6], rows[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
}

static inline float max8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float add8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* e^x for x <= 0 (or -inf) in float32, the same Cephes polynomial as exp16. AVX2 has no
 * scalef: 2^n is built in the exponent bits, which needs n >= -127; x is clamped at -88,
 * where n = -127 gives the bits of 0.0f, so e^x below about -87.3 is 0 (as is e^-inf). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

/* Lane o: the unscaled score q . key[o] for rows o < count <= 8 (0 for later rows), float32
 * fma on widened keys; each row gives a vector of 8 partial sums that sum_rows8 adds up.
 * Dims are the outer loop: each query vector is loaded once for all rows, and the rows' sums
 * are 8 independent fma chains (row by row, one chain of head_dim / 8 fmas waited on each
 * fma's latency). */
static inline __attribute__((always_inline)) __m256 chunk_scores8(
    const void *keys, int64_t base, int64_t count, const float *query, const int dtype,
    const int64_t head_dim) {
    __m256 rows[CHUNK8];
    for (int64_t o = 0; o < CHUNK8; ++o) rows[o] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 q = _mm256_load_ps(query + d);
        for (int64_t o = 0; o < CHUNK8; ++o)
            if (o < count)
                rows[o] = _mm256_fmadd_ps(load8(keys, base + o * head_dim + d, dtype), q, rows[o]);
    }
    return sum_rows8(rows);
}

/* Scores of up to STEP8 positions, as two vectors (lanes past the step's end already -inf)
 * -> their probabilities against the head's updated running max (those lanes 0); returns the
 * factor by which the head's earlier output and sum must be scaled (1 when the max held). */
static inline float softmax_step8(__m256 low, __m256 high, float *running_max,
                                  float *running_sum, float probs[STEP8]) {
    const float step_max = max8(_mm256_max_ps(low, high));
    float correction = 1.0f;
    if (step_max > *running_max) {
        correction = expf(*running_max - step_max);
        *running_max = step_max;
    }
    const __m256 max = _mm256_set1_ps(*running_max);
    low = exp8(_mm256_sub_ps(low, max));
    high = exp8(_mm256_sub_ps(high, max));
    _mm256_store_ps(probs, low);
    _mm256_store_ps(probs + CHUNK8, high);
    *running_sum = *running_sum * correction + add8(_mm256_add_ps(low, high));
    return correction;
}

/* Lanes o < n of `lanes` (0..7) kept, the others -inf: positions past the step's end. */
static inline __m256 mask_past(__m256 scores, __m256 lanes, int64_t n) {
    const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)n), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, valid);
}

/* Query head i's scores of the step's n <= STEP8 positions from element index `base` on:
 * chunk_scores8 on rows 0-7 and on rows 8-15, scaled, past the end -inf. Inlined with a
 * constant count for full chunks, so their row loops unroll. */
static inline __attribute__((always_inline)) void step_scores8(
    const Args *a, int64_t base, int64_t n, const float *query, const int dtype,
    const int64_t head_dim, __m256 *low, __m256 *high) {
    const __m256 scale = _mm256_set1_ps(a->scale);
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const void *keys = a->key_cache;
    *low = _mm256_mul_ps(n >= CHUNK8 ? chunk_scores8(keys, base, CHUNK8, query, dtype, head_dim)
                                     : chunk_scores8(keys, base, n, query, dtype, head_dim),
                         scale);
    *low = mask_past(*low, lanes, n);
    *high = _mm256_set1_ps(-INFINITY);
    if (n > CHUNK8) {
        const int64_t rest = n - CHUNK8, high_base = base + CHUNK8 * head_dim;
        *high = _mm256_mul_ps(
            rest == CHUNK8 ? chunk_scores8(keys, high_base, CHUNK8, query, dtype, head_dim)
                           : chunk_scores8(keys, high_base, rest, query, dtype, head_dim),
            scale);
        *high = mask_past(*high, lanes, rest);
    }
}

/* One query head's output: out += p[o] * value[o] for o < n, float32 fma on widened values,
 * in passes of up to 8 vectors (64 dims) held in registers. Each head reloads the values
 * (from L1): one load per fma either way, and no accumulator spills for any group size. Row o
 * of `future` (an element index, or -1) is prefetched along the way when `prefetch`. */
static inline __attribute__((always_inline)) void accumulate_values8(
    const Args *a, int64_t base, int64_t n, const float *probs, float correction, float *out,
    int64_t future, int prefetch, const int dtype, const int64_t head_dim) {
    const void *values = a->value_cache;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const int64_t num_vectors = (head_dim - d0) / 8 < 8 ? (head_dim - d0) / 8 : 8;
        const __m256 scale = _mm256_set1_ps(correction);
        __m256 sums[8];
        for (int64_t w = 0; w < num_vectors; ++w)
            sums[w] = _mm256_mul_ps(_mm256_load_ps(out + d0 + 8 * w), scale);
        for (int64_t o = 0; o < n; ++o) {
            if (prefetch && d0 == 0) prefetch_rows(a, future < 0 ? -1 : future + o * head_dim, 1);
            const __m256 p = _mm256_set1_ps(probs[o]);
            for (int64_t w = 0; w < num_vectors; ++w)
                sums[w] = _mm256_fmadd_ps(p, load8(values, base + o * head_dim + d0 + 8 * w, dtype),
                                          sums[w]);
        }
        for (int64_t w = 0; w < num_vectors; ++w) _mm256_store_ps(out + d0 + 8 * w, sums[w]);
    }
}

/* One item, as attend_item (AVX-512) does it: block by block, the item's kv heads inside a
 * block, steps of up to 16 positions, each query head's scores, softmax and values in turn.
 * Inlined with constant dtype, group and head_dim for the common shapes so the loops unroll
 * and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_item8(
    const Args *a, int64_t index, int64_t end_index, const int dtype, const int64_t group,
    const int64_t head_dim) {
    const Item item = item_of(a, index);
    const int64_t num_heads = item.num_kv_heads * group; /* query heads, local index h * G + g */
    const int64_t seq_len = a->seq_lens[item.seq], block_size = a->block_size;
    const int64_t *blocks = a->block_table + item.seq * a->max_blocks;
    const int64_t q_base = item.seq * a->q_stride + item.first_kv_head * group * head_dim;
    float query[MAX_ITEM_HEADS][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[MAX_ITEM_HEADS][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float probs[STEP8] __attribute__((aligned(32)));
    float running_max[MAX_ITEM_HEADS], running_sum[MAX_ITEM_HEADS];
    for (int64_t i = 0; i < num_heads; ++i) {
        for (int64_t d = 0; d < head_dim; ++d) {
            query[i][d] = load_float(a->q, q_base + i * head_dim + d, dtype);
            acc[i][d] = 0.0f;
        }
        running_max[i] = -INFINITY;
        running_sum[i] = 0.0f;
    }
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t in_block = seq_len - j * block_size < block_size ? seq_len - j * block_size
                                                                       : block_size;
        for (int64_t h = 0; h < item.num_kv_heads; ++h) {
            const int64_t future = future_block(a, index, end_index, j + PREFETCH_AHEAD, h);
            const int64_t block_start = block_base(a, blocks[j], item.first_kv_head + h);
            for (int64_t start = 0; start < in_block; start += STEP8) {
                const int64_t n = in_block - start < STEP8 ? in_block - start : STEP8;
                const int64_t base = block_start + start * head_dim;
                const int64_t future_rows = future < 0 ? -1 : future + start * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = h * group + g;
                    __m256 low, high;
                    step_scores8(a, base, n, query[i], dtype, head_dim, &low, &high);
                    const float correction =
                        softmax_step8(low, high, &running_max[i], &running_sum[i], probs);
                    accumulate_values8(a, base, n, probs, correction, acc[i], future_rows,
                                       g == 0, dtype, head_dim);
                }
            }
        }
    }
    const int64_t out_base = item.seq * a->out_stride + item.first_kv_head * group * head_dim;
    for (int64_t i = 0; i < num_heads; ++i) {
        const float inverse_sum = 1.0f / running_sum[i];
        for (int64_t d = 0; d < head_dim; ++d)
            store_float(a->out, out_base + i * head_dim + d, dtype, acc[i][d] * inverse_sum);
    }
}

#define SHAPE8(DTYPE, GROUP, DIM)                                              \
    if (a->dtype == DTYPE && group == GROUP && a->head_dim == DIM) {           \
        attend_item8(a, item, end_item, DTYPE, GROUP, DIM);                    \
        return;                                                                \
    }
#define SHAPES8(DTYPE)                                                         \
    SHAPE8(DTYPE, 1, 64) SHAPE8(DTYPE, 2, 64) SHAPE8(DTYPE, 3, 64) SHAPE8(DTYPE, 4, 64)  \
    SHAPE8(DTYPE, 8, 64) SHAPE8(DTYPE, 1, 128) SHAPE8(DTYPE, 2, 128) SHAPE8(DTYPE, 4, 128) \
    SHAPE8(DTYPE, 8, 128)

static void attend_vector8(const Args *a, int64_t item, int64_t end_item) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    SHAPES8(DTYPE_F32)
    SHAPES8(DTYPE_BF16)
    if (a->dtype == DTYPE_BF16)
        attend_item8(a, item, end_item, DTYPE_BF16, group, a->head_dim);
    else
        attend_item8(a, item, end_item, DTYPE_F32, group, a->head_dim);
}

#endif /* VECTOR_PATH == 2 */

/* One kv head of a sequence one position at a time, in plain C (any CPU, any head_dim). */
static void attend_portable_head(const Args *a, int64_t seq, int64_t kv_head) {
    const int64_t group = a->num_heads / a->num_kv_heads, head_dim = a->head_dim;
    const int64_t q_base = seq * a->q_stride + kv_head * group * head_dim;
    const int64_t seq_len = a->seq_lens[seq], block_size = a->block_size;
    const int64_t *blocks = a->block_table + seq * a->max_blocks;
    float query[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float key[MAX_HEAD_DIM], value[MAX_HEAD_DIM];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < head_dim; ++d) {
            query[g][d] = load_float(a->q, q_base + g * head_dim + d, a->dtype);
            acc[g][d] = 0.0f;
        }
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    for (int64_t position = 0; position < seq_len; ++position) {
        const int64_t row = block_base(a, blocks[position / block_size], kv_head) +
                            (position % block_size) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
            key[d] = load_float(a->key_cache, row + d, a->dtype);
            value[d] = load_float(a->value_cache, row + d, a->dtype);
        }
        for (int64_t g = 0; g < group; ++g) {
            float score = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) score += query[g][d] * key[d];
            score *= a->scale;
            const float new_max = running_max[g] > score ? running_max[g] : score;
            const float correction = expf(running_max[g] - new_max);
            const float weight = expf(score - new_max);
            running_sum[g] = running_sum[g] * correction + weight;
            running_max[g] = new_max;
            for (int64_t d = 0; d < head_dim; ++d)
                acc[g][d] = acc[g][d] * correction + weight * value[d];
        }
    }
    const int64_t out_base = seq * a->out_stride + kv_head * group * head_dim;
    for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
            store_float(a->out, out_base + g * head_dim + d, a->dtype,
                        acc[g][d] / running_sum[g]);
}

static void attend(const Args *a, int64_t index, int64_t end_index) {
#if VECTOR_PATH == 1
    if (a->head_dim % 16 == 0) {
        attend_vector(a, index, end_index);
        return;
    }
#elif VECTOR_PATH == 2
    if (a->head_dim % 8 == 0) {
        attend_vector8(a, index, end_index);
        return;
    }
#endif
    const Item item = item_of(a, index);
    for (int64_t h = 0; h < item.num_kv_heads; ++h)
        attend_portable_head(a, item.seq, item.first_kv_head + h);
}

/* Which vector path this build has: 1 AVX-512 (head_dim multiples of 16), 2 AVX2 + FMA
 * (head_dim multiples of 8), 0 none (the portable loop only). */
int vector_path(void) { return VECTOR_PATH; }

/* q [num_seqs, num_heads, head_dim] with q_stride elements between sequences; out likewise
 * with out_stride; block_table [num_seqs, max_blocks]; every seq_lens[b] >= 1 and covered by
 * its table row; num_heads / num_kv_heads <= MAX_GROUP, head_dim <= MAX_HEAD_DIM. dtype:
 * 0 float32, 1 bfloat16 (q, caches and out alike). */
void paged_decode(const void *q, int64_t q_stride, const void *key_cache,
                  const void *value_cache, const int64_t *block_table, int64_t max_blocks,
                  const int64_t *seq_lens, void *out, int64_t out_stride, int64_t num_seqs,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, float scale, int dtype, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    /* Whole sequences per item keep the reads consecutive; single kv heads when there are too
     * few sequences to share among the threads. */
    int64_t kv_heads_per_item = MAX_ITEM_HEADS / (num_heads / num_kv_heads);
    if (kv_heads_per_item > num_kv_heads) kv_heads_per_item = num_kv_heads;
    if (num_seqs < 4 * num_threads) kv_heads_per_item = 1;
    const Args args = {q, key_cache, value_cache, block_table, seq_lens, out, q_stride,
                       out_stride, max_blocks, num_heads, num_kv_heads, head_dim, block_size,
                       num_seqs, dtype == DTYPE_BF16 ? 2 : 4, kv_heads_per_item,
                       (num_kv_heads + kv_heads_per_item - 1) / kv_heads_per_item, scale, dtype};
    const int64_t num_items = num_seqs * args.items_per_seq;
    int64_t total_blocks = 0;
    for (int64_t b = 0; b < num_seqs; ++b) total_blocks += num_blocks_of(&args, b);
    total_blocks *= args.items_per_seq;
#pragma omp parallel num_threads(num_threads)
    {
        /* Thread t takes the items whose first block falls in its share of all blocks. */
        const int64_t t = omp_get_thread_num(), num_t = omp_get_num_threads();
        const int64_t low = total_blocks * t / num_t, high = total_blocks * (t + 1) / num_t;
        int64_t begin = num_items, end = num_items, seen = 0;
        for (int64_t index = 0; index < num_items; ++index) {
            if (seen >= low && begin == num_items) begin = index;
            if (seen >= high) {
                end = index;
                break;
            }
            seen += num_blocks_of(&args, index / args.items_per_seq);
        }
        for (int64_t index = begin; index < end; ++index) attend(&args, index, end);
    }
}
