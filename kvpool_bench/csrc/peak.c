/* This machine's ceilings for the engine's float32 work (kvpool_bench/roofline.py):
 *
 * fma_flops: multiply-adds per second over all OpenMP threads, from a loop of 10 independent
 *   FMA chains held in registers (no memory traffic): GCC vector types of the register's
 *   width, 16 floats (zmm) with AVX-512, 8 (ymm) without: wider vectors than the registers
 *   are split by the compiler and 10 of them no longer fit (AVX2 has 16 registers), so the
 *   loop would measure spills. A chain per register hides the FMA latency (4 cycles).
 * read_bytes: bytes per second summing `n` 4-byte integers (one pass, all threads, contiguous
 *   parts), each thread's part read as STREAMS interleaved sequential streams: one stream per
 *   core reads about half of what several do on a VM core (17 against 25-30 GB/s on 2 Emerald
 *   Rapids cores), and the decode attention, walking several sequences' blocks, reads at the
 *   higher rate. Integers, so the sum is exact at any size and the caller can check that
 *   every element was read.
 * Both time themselves with omp_get_wtime and return a rate; the sums are returned through
 * `sink` so the compiler keeps the work.
 */
#include <omp.h>
#include <stdint.h>

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));

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
        vec acc[CHAINS];
        const vec mul = (vec){0} + 0.999999f, add = (vec){0} + seed * 1e-7f;
        for (int c = 0; c < CHAINS; c++) acc[c] = (vec){0} + seed * (float)(c + 1 + omp_get_thread_num());
        for (int64_t i = 0; i < steps; i++)
            for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * mul + add;
        vec s = acc[0];
        for (int c = 1; c < CHAINS; c++) s += acc[c];
        for (int l = 0; l < LANES; l++) total += s[l];
    }
    const double dt = omp_get_wtime() - t0;
    *sink = total;
    return 2.0 * LANES * CHAINS * (double)steps * threads / dt;
}

#define STREAMS 8
#define RUN 16  /* integers a stream adds per turn: one 64-byte line */

double read_bytes(const int32_t *a, int64_t n, int64_t *sink) {
    double t0 = omp_get_wtime();
    int64_t total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        const int64_t len = (hi - lo) / (STREAMS * RUN) * RUN;  /* each stream's share */
        int64_t acc[STREAMS][RUN] = {{0}};
        for (int64_t i = 0; i < len; i += RUN)
            for (int s = 0; s < STREAMS; s++)
                for (int l = 0; l < RUN; l++) acc[s][l] += a[lo + s * len + i + l];
        for (int64_t i = lo + STREAMS * len; i < hi; i++) total += a[i];  /* the remainder */
        for (int s = 0; s < STREAMS; s++)
            for (int l = 0; l < RUN; l++) total += acc[s][l];
    }
    const double dt = omp_get_wtime() - t0;
    *sink = total;
    return 4.0 * (double)n / dt;
}
