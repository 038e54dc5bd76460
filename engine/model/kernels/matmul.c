/*
 * A Linear layer's matmul, y = x . W^T (+ bias), over weights laid out once at load in panels
 * of 16 output columns (engine/model/kernels/cpu_matmul.py packs them):
 *
 *     float32   panels[P][K][16]         panels[p][k][j] = W[16p + j][k]
 *     bfloat16  panels[P][K/2][16][2]    panels[p][k/2][j][k%2] = W[16p + j][k]   (K even)
 *
 * P = the output columns rounded up to a multiple of 32 (PANEL_PAIR), over 16; the padding
 * columns are zero and never stored. Each panel is one sequential stream of K 64-byte lines.
 *
 * Why: a decode step multiplies a few rows (one per running request) by every weight of the
 * model, so it is bound by how fast the weights stream from memory. oneDNN's packed matmul
 * streams them at ~26 GB/s on the AMD EPYC with AVX-512 measured (docs/performance.md); one
 * panel at a time with software prefetches PREFETCH_LINES ahead reaches ~42 GB/s there, and
 * in bf16 the AVX512_BF16 dot product keeps up with it.
 *
 * Two tiles:
 * - up to SMALL_TILE_ROWS rows (decode): 16 rows x 1 panel, 16 accumulators;
 * - more rows (prefill, compute-bound): BIG_ROWS rows x 2 panels (24 accumulators, so each
 *   row's value is loaded once for two weight vectors), blocks of ROW_BLOCK rows kept hot
 *   while the panels go by.
 * Both prefetch the weights; a short last tile reads a zero-padded copy of its rows. Without
 * AVX-512 (AVX2's 16 registers of 8 floats) both are made of tiles of up to 6 rows x 1 panel
 * (12 accumulators): the small one of 6, 6 and 4 rows (as many as there are rows), the big
 * one of 6 rows, one panel after the other; on an AVX2 EPYC a decode step's matmuls took
 * 0.67-0.77x oneDNN's time at 16 rows, 0.88x at 1,024 (docs/performance.md).
 *
 * The MLP's gate and up projections can run as one (ACT_SILU_AND_MUL, below): each pair of
 * tiles then stores silu(gate) * up instead of both products, a pass over them less.
 *
 * Sums run in float32 in a different order than oneDNN's (about 1e-6 relative). bfloat16
 * products are exact in float32 (VDPBF16PS), the bias is added in float32 and the result
 * rounded once to bfloat16, nearest even, as torch's bf16 Linear. The float32 tiles are gcc
 * vector code (any x86-64 build: vectors of 16 floats with AVX-512, of 8 elsewhere);
 * the bfloat16 tiles need AVX512_BF16: without it, matmul() returns -1 for bf16. The caller
 * (cpu_matmul.py) checks shapes, dtypes and contiguity; the kernel trusts them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vector.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2 /* L2; the build sets 3 (L1) on AMD CPUs with AVX-512 */
#endif
#define PANEL 16
#define PANEL_PAIR 32
#define SMALL_TILE_ROWS 16
#if defined(__AVX512F__)
#define BIG_ROWS 12
#else
#define NARROW_ROWS 6 /* the most rows of a tile without AVX-512 */
#define BIG_ROWS NARROW_ROWS
#endif
#define ROW_BLOCK 192 /* a multiple of BIG_ROWS */
#define PREFETCH_LINES 128

_Static_assert(VECTOR_LANES == 16, "a panel is one vector of 16 floats");
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

enum { ACT_NONE = 0, ACT_SILU_AND_MUL = 1 };

/* ------------------------------------------------------------------------------------ */
/* Stores: the valid columns of one panel's 16 results for one row.                       */

/* The bias of the valid columns only: a short last panel's bias ends with them. */
static inline vfloat with_bias(vfloat acc, const float *bias, int64_t columns) {
    if (bias) {
        const int64_t valid = columns < PANEL ? columns : PANEL;
        for (int64_t j = 0; j < valid; j++) acc[j] += bias[j];
    }
    return acc;
}

static inline void store_f32(float *y, vfloat acc, const float *bias, int64_t columns) {
    acc = with_bias(acc, bias, columns);
    if (columns >= PANEL) {
        memcpy(y, &acc, sizeof acc);
    } else {
        for (int64_t j = 0; j < columns; j++) y[j] = acc[j];
    }
}

/* 16 floats rounded to bfloat16 at once, as float_to_bf16 rounds each (nearest even, NaN
 * to 0x7FC0). */
static inline v16u16 round_to_bf16(vfloat acc) {
    v16u bits;
    memcpy(&bits, &acc, sizeof bits);
    const v16u rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
    const v16u is_nan = (v16u)(acc != acc);
    return __builtin_convertvector((rounded & ~is_nan) | (0x7FC0 & is_nan), v16u16);
}

static inline void store_bf16(uint16_t *y, vfloat acc, const float *bias, int64_t columns) {
    const v16u16 rounded = round_to_bf16(with_bias(acc, bias, columns));
    if (columns >= PANEL) {
        memcpy(y, &rounded, sizeof rounded);
    } else {
        for (int64_t j = 0; j < columns; j++) y[j] = rounded[j];
    }
}

/* bf16 rounding of 16 floats, widened back to float32 (a bf16 tensor's values, in float). */
static inline vfloat as_bf16(vfloat acc) {
    const v16u widened = __builtin_convertvector(round_to_bf16(acc), v16u) << 16;
    vfloat value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

static inline vfloat silu_lanes(vfloat x) { return x / (1.0f + exp_lanes(-x)); }

/* silu(gate) * up for one row's 16 columns, stored in the dtype, rounded as torch's bf16 ops
 * round: the matmul's gate and up, the SiLU and the product each once. */
static inline void store_gated(void *y, int dtype, vfloat gate, vfloat up, int64_t columns) {
    if (dtype == DTYPE_BF16) {
        const vfloat product = as_bf16(silu_lanes(as_bf16(gate))) * as_bf16(up);
        store_bf16(y, product, NULL, columns);
    } else {
        store_f32(y, silu_lanes(gate) * up, NULL, columns);
    }
}

/* ------------------------------------------------------------------------------------ */
/* float32                                                                                */

#if defined(__AVX512F__)
/* 16 rows of x (stride k) x one panel -> acc[16] (``valid``: rows that matter; all are
 * computed, the weights' stream sets the time). */
static inline void small_tile_f32(const float *x, int64_t k, const float *panel, int64_t valid,
                                  vfloat acc[16]) {
    (void)valid;
    for (int m = 0; m < SMALL_TILE_ROWS; m++) acc[m] = (vfloat){0};
    for (int64_t i = 0; i < k; i++) {
        __builtin_prefetch(panel + (i + PREFETCH_LINES) * PANEL, 0, PREFETCH_LOCALITY);
        const vfloat w = *(const vfloat *)(panel + i * PANEL);
#pragma GCC unroll 16
        for (int m = 0; m < SMALL_TILE_ROWS; m++) acc[m] += x[m * k + i] * w;
    }
}

/* BIG_ROWS rows x two panels -> a0, a1. */
static inline void big_tile_f32(const float *x, int64_t k, const float *p0, const float *p1,
                                vfloat a0[BIG_ROWS], vfloat a1[BIG_ROWS]) {
    for (int m = 0; m < BIG_ROWS; m++) a0[m] = a1[m] = (vfloat){0};
    for (int64_t i = 0; i < k; i++) {
        __builtin_prefetch(p0 + (i + PREFETCH_LINES) * PANEL, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(p1 + (i + PREFETCH_LINES) * PANEL, 0, PREFETCH_LOCALITY);
        const vfloat u = *(const vfloat *)(p0 + i * PANEL), v = *(const vfloat *)(p1 + i * PANEL);
#pragma GCC unroll 12
        for (int m = 0; m < BIG_ROWS; m++) {
            const float s = x[m * k + i];
            a0[m] += s * u;
            a1[m] += s * v;
        }
    }
}
#else
/* Without AVX-512 (AVX2: 16 vector registers of 8 floats) a tile is ``rows`` rows x one panel,
 * the panel's line as two vectors of 8: 2 * rows sums, at most 12 (4 registers left for the
 * weights and a row's value). gcc moves wider vectors (vfloat) through the stack, so the sums
 * are kept as v8 and joined into vfloat only for the stores. */
typedef float v8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) void narrow_tile_f32(
    const float *x, int64_t k, const float *panel, vfloat *acc, const int rows) {
    v8 lo[NARROW_ROWS], hi[NARROW_ROWS];
    for (int m = 0; m < rows; m++) lo[m] = hi[m] = (v8){0};
    for (int64_t i = 0; i < k; i++) {
        __builtin_prefetch(panel + (i + PREFETCH_LINES) * PANEL, 0, PREFETCH_LOCALITY);
        const v8 wl = *(const v8 *)(panel + i * PANEL), wh = *(const v8 *)(panel + i * PANEL + 8);
#pragma GCC unroll 6
        for (int m = 0; m < rows; m++) {
            const float value = x[m * k + i];
            lo[m] += value * wl;
            hi[m] += value * wh;
        }
    }
    for (int m = 0; m < rows; m++) {
        memcpy(&acc[m], &lo[m], sizeof lo[m]);
        memcpy((char *)&acc[m] + sizeof lo[m], &hi[m], sizeof hi[m]);
    }
}

/* Up to 16 rows x one panel -> acc[16], in tiles of 6, 6 and 4 rows: the first streams the
 * panel from memory, the next read it from cache; tiles past ``valid`` rows are skipped.
 * (Tiles of 4 rows, 8 sums each, took 1.2-1.4x longer at 16 rows.) */
static inline void small_tile_f32(const float *x, int64_t k, const float *panel, int64_t valid,
                                  vfloat acc[16]) {
    const int64_t second = NARROW_ROWS, third = 2 * NARROW_ROWS;
    narrow_tile_f32(x, k, panel, acc, NARROW_ROWS);
    if (valid > second) narrow_tile_f32(x + second * k, k, panel, acc + second, NARROW_ROWS);
    if (valid > third)
        narrow_tile_f32(x + third * k, k, panel, acc + third, SMALL_TILE_ROWS - third);
}

/* BIG_ROWS rows x two panels -> a0, a1: one panel, then the other. */
static inline void big_tile_f32(const float *x, int64_t k, const float *p0, const float *p1,
                                vfloat a0[BIG_ROWS], vfloat a1[BIG_ROWS]) {
    narrow_tile_f32(x, k, p0, a0, BIG_ROWS);
    narrow_tile_f32(x, k, p1, a1, BIG_ROWS);
}
#endif

/* ------------------------------------------------------------------------------------ */
/* bfloat16 (AVX512_BF16): a weight line holds 16 columns x 2 consecutive k; a row's pair   */
/* of x values is broadcast as one 32-bit word.                                             */

#if defined(__AVX512BF16__)
static inline __m512bh pair_of(const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline void small_tile_bf16(const uint16_t *x, int64_t k, const uint16_t *panel,
                                   vfloat acc[16]) {
    __m512 sum[SMALL_TILE_ROWS];
    for (int m = 0; m < SMALL_TILE_ROWS; m++) sum[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / 2; i++) {
        __builtin_prefetch(panel + (i + PREFETCH_LINES) * 2 * PANEL, 0, PREFETCH_LOCALITY);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + i * 2 * PANEL);
#pragma GCC unroll 16
        for (int m = 0; m < SMALL_TILE_ROWS; m++)
            sum[m] = _mm512_dpbf16_ps(sum[m], pair_of(x + m * k + 2 * i), w);
    }
    for (int m = 0; m < SMALL_TILE_ROWS; m++) acc[m] = (vfloat)sum[m];
}

static inline void big_tile_bf16(const uint16_t *x, int64_t k, const uint16_t *p0,
                                 const uint16_t *p1, vfloat a0[BIG_ROWS], vfloat a1[BIG_ROWS]) {
    __m512 s0[BIG_ROWS], s1[BIG_ROWS];
    for (int m = 0; m < BIG_ROWS; m++) s0[m] = s1[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / 2; i++) {
        __builtin_prefetch(p0 + (i + PREFETCH_LINES) * 2 * PANEL, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(p1 + (i + PREFETCH_LINES) * 2 * PANEL, 0, PREFETCH_LOCALITY);
        const __m512bh u = (__m512bh)_mm512_loadu_si512(p0 + i * 2 * PANEL);
        const __m512bh v = (__m512bh)_mm512_loadu_si512(p1 + i * 2 * PANEL);
#pragma GCC unroll 12
        for (int m = 0; m < BIG_ROWS; m++) {
            const __m512bh pair = pair_of(x + m * k + 2 * i);
            s0[m] = _mm512_dpbf16_ps(s0[m], pair, u);
            s1[m] = _mm512_dpbf16_ps(s1[m], pair, v);
        }
    }
    for (int m = 0; m < BIG_ROWS; m++) {
        a0[m] = (vfloat)s0[m];
        a1[m] = (vfloat)s1[m];
    }
}
#endif

/* ------------------------------------------------------------------------------------ */
/* Driving the tiles; dtype-generic through these two.                                     */

typedef struct {
    const void *x;
    int64_t rows, k, n;
    const void *panels;
    const float *bias;
    void *y;
    int dtype;
    int act; /* ACT_SILU_AND_MUL: panels 2j and 2j + 1 are gate and up columns 16j.. */
    int64_t size; /* bytes an element of x, y and the panels: 2 (bf16) or 4 */
} Problem;

static inline void store_row(const Problem *pb, int64_t row, int64_t panel, vfloat acc) {
    const int64_t column = panel * PANEL, columns = pb->n - column;
    if (columns <= 0) return; /* a padding panel */
    const float *bias = pb->bias ? pb->bias + column : NULL;
    if (pb->dtype == DTYPE_BF16)
        store_bf16((uint16_t *)pb->y + row * pb->n + column, acc, bias, columns);
    else
        store_f32((float *)pb->y + row * pb->n + column, acc, bias, columns);
}

/* Row ``row`` of panel pair ``pair`` with ACT_SILU_AND_MUL: output columns 16 * pair on. */
static inline void store_gated_row(const Problem *pb, int64_t row, int64_t pair, vfloat gate,
                                   vfloat up) {
    const int64_t column = pair * PANEL, columns = pb->n - column;
    if (columns <= 0) return;
    store_gated((char *)pb->y + (row * pb->n + column) * pb->size, pb->dtype, gate, up, columns);
}

static inline const void *panel_at(const Problem *pb, int64_t panel) {
    /* K x 16 elements a panel in either layout */
    return (const char *)pb->panels + panel * pb->k * PANEL * pb->size;
}

/* A tile's rows of x: from x itself, or from ``padded`` (the last tile's rows, zero-padded to a
 * full tile) when fewer than ``tile_rows`` are left. */
static inline const void *tile_rows_at(const Problem *pb, const void *padded, int64_t row,
                                       int64_t tile_rows) {
    if (pb->rows - row < tile_rows) return padded;
    return (const char *)pb->x + row * pb->k * pb->size;
}

static inline int64_t valid_rows(const Problem *pb, int64_t row, int64_t tile_rows) {
    return pb->rows - row < tile_rows ? pb->rows - row : tile_rows;
}

/* The small tile of one panel -> acc. */
static inline void small_tile(const Problem *pb, const void *x, int64_t panel,
                              vfloat acc[SMALL_TILE_ROWS]) {
#if defined(__AVX512BF16__)
    if (pb->dtype == DTYPE_BF16)
        small_tile_bf16(x, pb->k, panel_at(pb, panel), acc);
    else
#endif
        small_tile_f32(x, pb->k, panel_at(pb, panel), pb->rows, acc);
}

/* The small tile of a panel, or with ACT_SILU_AND_MUL of a pair: the first ``valid`` rows,
 * read from ``x``. */
static inline void run_small_tile(const Problem *pb, const void *x, int64_t valid, int64_t index) {
    vfloat acc[SMALL_TILE_ROWS];
    if (pb->act == ACT_SILU_AND_MUL) {
        vfloat up[SMALL_TILE_ROWS];
        small_tile(pb, x, 2 * index, acc);
        small_tile(pb, x, 2 * index + 1, up);
        for (int64_t m = 0; m < valid; m++) store_gated_row(pb, m, index, acc[m], up[m]);
        return;
    }
    small_tile(pb, x, index, acc);
    for (int64_t m = 0; m < valid; m++) store_row(pb, m, index, acc[m]);
}

/* Ask for the lines a big tile will store into, for writing, before its loop: each is written
 * once and is not in cache, so each store would wait for its line otherwise (the float32
 * 3,072-column projection: 1.09x oneDNN's time without, 1.02x with). */
static inline void prefetch_outputs(const Problem *pb, int64_t row, int64_t valid, int64_t panel) {
    for (int64_t m = 0; m < valid; m++) {
        const int64_t column = pb->act == ACT_SILU_AND_MUL ? panel / 2 * PANEL : panel * PANEL;
        const char *out = (const char *)pb->y + ((row + m) * pb->n + column) * pb->size;
        __builtin_prefetch(out, 1, 3);
        __builtin_prefetch(out + 64, 1, 3);
    }
}

/* A big tile: rows from ``row`` on, read from ``x``, by panels 2 * pair and 2 * pair + 1. */
static inline void run_big_tile(const Problem *pb, const void *x, int64_t row, int64_t pair) {
    vfloat a0[BIG_ROWS], a1[BIG_ROWS];
    const int64_t panel = 2 * pair, valid = valid_rows(pb, row, BIG_ROWS);
    prefetch_outputs(pb, row, valid, panel);
#if defined(__AVX512BF16__)
    if (pb->dtype == DTYPE_BF16)
        big_tile_bf16(x, pb->k, panel_at(pb, panel), panel_at(pb, panel + 1), a0, a1);
    else
#endif
        big_tile_f32(x, pb->k, panel_at(pb, panel), panel_at(pb, panel + 1), a0, a1);
    for (int64_t m = 0; m < valid; m++) {
        if (pb->act == ACT_SILU_AND_MUL) {
            store_gated_row(pb, row + m, pair, a0[m], a1[m]);
            continue;
        }
        store_row(pb, row + m, panel, a0[m]);
        store_row(pb, row + m, panel + 1, a1[m]);
    }
}

/* Up to SMALL_TILE_ROWS rows: one small tile for each panel (each pair, gated). */
static void small_rows(const Problem *pb, const void *padded, int64_t num_panels, int num_threads) {
    const void *x = tile_rows_at(pb, padded, 0, SMALL_TILE_ROWS);
    const int64_t num_tiles = pb->act == ACT_SILU_AND_MUL ? num_panels / 2 : num_panels;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t index = 0; index < num_tiles; index++) run_small_tile(pb, x, pb->rows, index);
}

/* More rows: big tiles in blocks of ROW_BLOCK rows (a block of x stays in cache while the
 * panel pairs go by), each block's pairs shared by the threads. */
static void big_rows(const Problem *pb, const void *padded, int64_t num_panels, int num_threads) {
    const int64_t num_pairs = num_panels / 2;
#pragma omp parallel num_threads(num_threads)
    for (int64_t first = 0; first < pb->rows; first += ROW_BLOCK) {
        const int64_t end = first + ROW_BLOCK < pb->rows ? first + ROW_BLOCK : pb->rows;
#pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < num_pairs; pair++) {
            for (int64_t row = first; row < end; row += BIG_ROWS)
                run_big_tile(pb, tile_rows_at(pb, padded, row, BIG_ROWS), row, pair);
        }
    }
}

/*
 * y[rows][n] = x[rows][k] . W^T (+ bias[n], float32, or NULL), in ``dtype`` (DTYPE_F32 or
 * DTYPE_BF16; bias always float32); ``panels`` as above. With ``act`` ACT_SILU_AND_MUL (no
 * bias) the panels hold a gate and an up projection, pair by pair (panel 2j: gate columns
 * 16j.., panel 2j + 1: the up columns beside them; cpu_matmul.py pack_gated), and
 * y[rows][n] = silu(x . gate^T) * (x . up^T), n the gate's columns. 0 on success; -1 for
 * bfloat16 in a build without AVX512_BF16, a bias with ACT_SILU_AND_MUL, or when a scratch
 * tile cannot be allocated.
 */
int matmul(const void *x, int64_t rows, int64_t k, const void *panels, int64_t n,
           const float *bias, void *y, int dtype, int act, int num_threads) {
#if !defined(__AVX512BF16__)
    if (dtype == DTYPE_BF16) return -1;
#endif
    if (rows <= 0) return 0;
    if (act == ACT_SILU_AND_MUL && bias) return -1;
    const int64_t size = dtype == DTYPE_BF16 ? 2 : 4;
    const Problem pb = {x, rows, k, n, panels, bias, y, dtype, act, size};
    const int64_t num_panels = act == ACT_SILU_AND_MUL ? (n + PANEL - 1) / PANEL * 2
                                                       : (n + PANEL_PAIR - 1) / PANEL_PAIR * 2;
    const int64_t tile_rows = rows <= SMALL_TILE_ROWS ? SMALL_TILE_ROWS : BIG_ROWS;
    const int64_t short_rows = rows % tile_rows;
    void *padded = NULL;
    if (short_rows) {
        padded = calloc((size_t)(tile_rows * k), (size_t)size);
        if (!padded) return -1;
        memcpy(padded, (const char *)x + (rows - short_rows) * k * size,
               (size_t)(short_rows * k * size));
    }
    if (tile_rows == SMALL_TILE_ROWS)
        small_rows(&pb, padded, num_panels, num_threads);
    else
        big_rows(&pb, padded, num_panels, num_threads);
    free(padded);
    return 0;
}
