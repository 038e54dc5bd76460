/* Vectors of 16 floats for the CPU kernels (gcc's vector types: one AVX-512 register, two AVX2
 * ones, four SSE ones), a lane select and e^x. (Headers next to a kernel's source are part of
 * its build key: engine/model/kernels/cpu_build.py.) */
#ifndef ITERSCOPE_VECTOR16_H
#define ITERSCOPE_VECTOR16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* where ``mask`` (a vector comparison) holds, ``a``; elsewhere ``b``. */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* e^x (Cephes' expf, within 2 ulp): x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6
 * polynomial, times 2^n added to the exponent bits; x is clamped to [-87.34, 88.72], where
 * float32 has normal results (below: ~1.2e-38; above: ~3.4e38). */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.33654f, hi = (v16){0} + 88.72283f;
    x = select16(x < lo, lo, x);
    x = select16(x > hi, hi, x);
    const v16 t = x * 1.44269504088896341f;
    v16i t_bits;
    memcpy(&t_bits, &t, sizeof t_bits);
    const v16i half_bits = (t_bits & (int32_t)0x80000000) | 0x3F000000; /* +-0.5, t's sign */
    v16 half;
    memcpy(&half, &half_bits, sizeof half);
    const v16i n = __builtin_convertvector(t + half, v16i); /* t rounded to nearest */
    const v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i bits;
    memcpy(&bits, &p, sizeof bits);
    bits += n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

#endif
