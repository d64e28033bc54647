/* This machine's ceilings for the engine's float32 work (kvpool_bench/roofline.py):
 *
 * fma_flops: multiply-adds per second over all OpenMP threads, from a loop of 10 independent
 *   16-float FMA chains held in registers (no memory traffic): GCC vector types, so one zmm
 *   FMA a step with AVX-512 and two ymm with AVX2, whichever -march=native gives. A chain
 *   per register hides the FMA latency (4 cycles) behind the other 9.
 * read_bytes: bytes per second summing `n` 4-byte integers (one pass, all threads, contiguous
 *   parts), the hardware prefetchers' best case; integers, so the sum is exact at any size and
 *   the caller can check that every element was read.
 * Both time themselves with omp_get_wtime and return a rate; the sums are returned through
 * `sink` so the compiler keeps the work.
 */
#include <omp.h>
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));

#define CHAINS 10

double fma_flops(int64_t steps, float seed, float *sink) {
    double t0 = omp_get_wtime();
    float total = 0.f;
    int threads = 1;
#pragma omp parallel reduction(+ : total)
    {
#pragma omp single
        threads = omp_get_num_threads();
        /* Distinct starting values (from a runtime seed): equal chains could be merged. */
        v16 acc[CHAINS];
        const v16 mul = (v16){0} + 0.999999f, add = (v16){0} + seed * 1e-7f;
        for (int c = 0; c < CHAINS; c++) acc[c] = (v16){0} + seed * (float)(c + 1 + omp_get_thread_num());
        for (int64_t i = 0; i < steps; i++)
            for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * mul + add;
        v16 s = acc[0];
        for (int c = 1; c < CHAINS; c++) s += acc[c];
        for (int l = 0; l < 16; l++) total += s[l];
    }
    const double dt = omp_get_wtime() - t0;
    *sink = total;
    return 2.0 * 16 * CHAINS * (double)steps * threads / dt;
}

double read_bytes(const int32_t *a, int64_t n, int64_t *sink) {
    double t0 = omp_get_wtime();
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += a[i];
    const double dt = omp_get_wtime() - t0;
    *sink = total;
    return 4.0 * (double)n / dt;
}
