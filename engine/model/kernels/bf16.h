/* bfloat16 <-> float32 for the CPU kernels, rounding as torch rounds, and float32 access to
 * an element of a tensor of either dtype (DTYPE_*: the codes the Python wrappers pass).
 * (Headers next to a kernel's source are part of its build key:
 * engine/model/kernels/cpu_build.py.) */
#ifndef ITERSCOPE_BF16_H
#define ITERSCOPE_BF16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float load_float(const void *base, int64_t index, int dtype) {
    if (dtype == DTYPE_BF16) return bf16_to_float(((const uint16_t *)base)[index]);
    return ((const float *)base)[index];
}

static inline void store_float(void *base, int64_t index, int dtype, float value) {
    if (dtype == DTYPE_BF16)
        ((uint16_t *)base)[index] = float_to_bf16(value);
    else
        ((float *)base)[index] = value;
}

#endif
