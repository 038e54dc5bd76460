/*
 * The residual add and the RMSNorm after it in one pass over each row (engine/model/decoder.py):
 *
 *     residual += delta                  (skipped when delta is NULL)
 *     out = residual * rsqrt(mean(residual^2) + eps) * weight
 *
 * Rounding follows torch's, so the results are torch's up to the order of the sum of squares:
 * bfloat16 rows are added in float32 and rounded to bfloat16 (as torch's bf16 add), and the
 * norm is computed in float32 and rounded once, after the weight (as torch's rms_norm, which
 * upcasts its input and multiplies by the weight before the cast back). Rows are spread over
 * OpenMP threads from PARALLEL_FROM_ROWS rows on; fewer (decode) stay on the calling thread.
 * Every pointer is contiguous [rows, dim] (weight [dim]); dim <= MAX_DIM. The caller checks.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define MAX_DIM 16384
#define PARALLEL_FROM_ROWS 64

static void row_bf16(uint16_t *residual, const uint16_t *delta, uint16_t *out,
                     const uint16_t *weight, int64_t dim, float eps) {
    float x[MAX_DIM];
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        float value = bf16_to_float(residual[i]);
        if (delta) {
            const uint16_t rounded = float_to_bf16(value + bf16_to_float(delta[i]));
            residual[i] = rounded;
            value = bf16_to_float(rounded);
        }
        x[i] = value;
        sum += value * value;
    }
    const float rstd = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++)
        out[i] = float_to_bf16(x[i] * rstd * bf16_to_float(weight[i]));
}

static void row_f32(float *residual, const float *delta, float *out, const float *weight,
                    int64_t dim, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        if (delta) residual[i] += delta[i];
        sum += residual[i] * residual[i];
    }
    const float rstd = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = residual[i] * rstd * weight[i];
}

void add_rms_norm(void *residual, const void *delta, void *out, const void *weight, int64_t rows,
                  int64_t dim, float eps, int dtype, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_FROM_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * dim;
        if (dtype == DTYPE_BF16)
            row_bf16((uint16_t *)residual + at, delta ? (const uint16_t *)delta + at : NULL,
                     (uint16_t *)out + at, (const uint16_t *)weight, dim, eps);
        else
            row_f32((float *)residual + at, delta ? (const float *)delta + at : NULL,
                    (float *)out + at, (const float *)weight, dim, eps);
    }
}
