/* SIMD helpers the C kernels share (the attention kernels and layer_ops.c include this file;
 * a build's cache key hashes the headers its source includes): AVX-512 ones where the compiler
 * targets AVX-512, exp256 where it targets AVX2 with FMA.
 *
 * hmax256 / hsum256: a vector's lanes reduced (AVX2).
 * exp512 / exp256: exp over 16 / 8 floats, for the softmax (x <= 0 there: scores minus their
 * running max) and SiLU. Cephes-style: n = round(x / ln 2), r = x - n ln 2 in two steps, a
 * degree-6 polynomial, times 2^n (vscalefps; AVX2 builds 2^n's exponent bits, n >= -126 after
 * the clamp); |rel err| < 2 ulp up to x ~ 88, +inf past it (as exp overflows). The clamp
 * below keeps 2^n representable and turns the kernels' -3e38 "no max yet" sentinel into a
 * factor of ~0. */
#ifndef KVPOOL_SIMD_H
#define KVPOOL_SIMD_H
#include <immintrin.h>

#ifdef __AVX512F__
static inline __m512 exp512(__m512 x) {
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

/* A 64-float row (one head's K or V) as four vectors kept in registers, for a loop that uses it
 * for several query rows or heads. The empty asm stops gcc from folding each use into an FMA's
 * memory operand instead, a reload per use: this core does one 512-bit load per cycle, which
 * made such loops load-bound. (Four outputs, not an array: an array went through the stack.) */
static inline __attribute__((always_inline)) void load_row64(const float *src, __m512 *r0, __m512 *r1,
                                                             __m512 *r2, __m512 *r3) {
    *r0 = _mm512_loadu_ps(src);
    *r1 = _mm512_loadu_ps(src + 16);
    *r2 = _mm512_loadu_ps(src + 32);
    *r3 = _mm512_loadu_ps(src + 48);
    __asm__("" : "+v"(*r0), "+v"(*r1), "+v"(*r2), "+v"(*r3));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The max / the sum of v's 8 lanes (a fixed order: the same bits wherever it is called). */
static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
