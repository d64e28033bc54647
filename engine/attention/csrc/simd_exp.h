/* exp over 16 floats for the attention kernels' softmax (AVX-512): x <= 0 there (scores minus
 * their running max). Cephes-style: n = round(x / ln 2), r = x - n ln 2 in two steps, a degree-6
 * polynomial, 2^n by vscalefps; |rel err| < 2 ulp over the softmax's range. The clamp keeps 2^n
 * representable and turns the kernels' -3e38 "no max yet" sentinel into a factor of ~0.
 * Included by each kernel source (the kernel cache key hashes this directory's headers too). */
#ifndef KVPOOL_SIMD_EXP_H
#define KVPOOL_SIMD_EXP_H
#include <immintrin.h>

static inline __m512 exp512(__m512 x) {
    /* x <= 0 here (scores minus their running max); clamp keeps 2^n representable */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif
