/* Vectors of VECTOR_LANES floats for the CPU kernels (gcc's vector types), a lane select and
 * e^x. A kernel defines VECTOR_LANES before including this (default 16): a vector is best one
 * register of the build's CPU, 16 floats with AVX-512, 8 with AVX2. gcc compiles a wider one
 * as several registers but moves much of it through the stack: the prefill attention kernel
 * ran 5x slower on an AVX2 EPYC with 16-float vectors than with 8 (docs/performance.md).
 * (Headers next to a kernel's source are part of its build key:
 * engine/model/kernels/cpu_build.py.) */
#ifndef ITERSCOPE_VECTOR_H
#define ITERSCOPE_VECTOR_H

#include <stdint.h>
#include <string.h>

#ifndef VECTOR_LANES
#define VECTOR_LANES 16
#endif

typedef float vfloat __attribute__((vector_size(VECTOR_LANES * 4)));
typedef int32_t vint __attribute__((vector_size(VECTOR_LANES * 4)));

/* where ``mask`` (a vector comparison) holds, ``a``; elsewhere ``b``. */
static inline vfloat select_lanes(vint mask, vfloat a, vfloat b) {
    return (vfloat)(((vint)a & mask) | ((vint)b & ~mask));
}

/* e^x (Cephes' expf, within 2 ulp): x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6
 * polynomial, times 2^n added to the exponent bits; x is clamped to [-87.34, 88.72], where
 * float32 has normal results (below: ~1.2e-38; above: ~3.4e38). */
static inline vfloat exp_lanes(vfloat x) {
    const vfloat lo = (vfloat){0} - 87.33654f, hi = (vfloat){0} + 88.72283f;
    x = select_lanes(x < lo, lo, x);
    x = select_lanes(x > hi, hi, x);
    const vfloat t = x * 1.44269504088896341f;
    vint t_bits;
    memcpy(&t_bits, &t, sizeof t_bits);
    const vint half_bits = (t_bits & (int32_t)0x80000000) | 0x3F000000; /* +-0.5, t's sign */
    vfloat half;
    memcpy(&half, &half_bits, sizeof half);
    const vint n = __builtin_convertvector(t + half, vint); /* t rounded to nearest */
    const vfloat nf = __builtin_convertvector(n, vfloat);
    vfloat r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    vfloat p = (vfloat){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vint bits;
    memcpy(&bits, &p, sizeof bits);
    bits += n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

#endif
