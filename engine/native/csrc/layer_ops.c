/* The elementwise steps of a decoder layer on CPU, fused (float32): each is one pass over its
 * rows instead of 3-6 torch ops, which at decode batch sizes are dominated by per-op dispatch,
 * not by the arithmetic. Rows are spread over torch's OpenMP threads when there are enough of
 * them to pay for a parallel region (prefill chunks); a decode step's few rows run on the
 * calling thread.
 *
 * Numerics: the same formulas as engine/model.py's torch path (RMSNorm in float32,
 * x * rsqrt(mean(x^2) + eps) * w; RoPE x * cos + roll(x) * sin_signed; silu(g) * u); the sums run
 * in a different order, so results agree to float32 rounding, not to the bit.
 *
 * And gemm_f32 / gemm_silu_f32, the linears' matmul over weights packed in panels (below).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define PAR_ROWS 16   /* fewer rows than this: no parallel region */

static inline float row_inv_rms(const float *x, int64_t dim, float eps) {
    float ss = 0.f;
    for (int64_t d = 0; d < dim; d++) ss += x[d] * x[d];
    /* volatile keeps the square root a square root: -ffast-math turns 1 / sqrtf into an rsqrt
     * estimate and a Newton step, and the estimate's bits differ between Intel and AMD cores
     * (engine/native/build.py: a class's CPUs must compute the same KV). Once per row. */
    volatile float root = sqrtf(ss / (float)dim + eps);
    return 1.f / root;
}

/* out[i] = x[i] * rsqrt(mean(x[i]^2) + eps) * w; rows of x and out are `dim` long, contiguous. */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t n, int64_t dim, float eps) {
    #pragma omp parallel for if (n >= PAR_ROWS) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * dim;
        float *o = out + i * dim;
        const float r = row_inv_rms(xr, dim, eps);
        for (int64_t d = 0; d < dim; d++) o[d] = xr[d] * r * w[d];
    }
}

/* h[i] += delta[i] (the residual stream, in place), then out[i] = rms_norm(h[i]) * w. */
void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int64_t n, int64_t dim,
                      float eps) {
    #pragma omp parallel for if (n >= PAR_ROWS) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *hr = h + i * dim;
        const float *dr = delta + i * dim;
        float *o = out + i * dim;
        for (int64_t d = 0; d < dim; d++) hr[d] += dr[d];
        const float r = row_inv_rms(hr, dim, eps);
        for (int64_t d = 0; d < dim; d++) o[d] = hr[d] * r * w[d];
    }
}

/* RoPE in place on `heads` heads of each row: x = x * cos + roll(x, head_dim / 2) * sin_signed,
 * where cos / sin_signed rows come from the tables at the row's position. Row i of x starts at
 * x + i * row_stride (heads contiguous, head_dim each); tables are [max_position, head_dim]. */
void rope_f32(float *x, int64_t row_stride, const int64_t *positions, const float *cos_t, const float *sin_t,
              int64_t n, int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for if (n >= PAR_ROWS) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos_t + positions[i] * head_dim;
        const float *s = sin_t + positions[i] * head_dim;
        for (int64_t hh = 0; hh < heads; hh++) {
            float *v = x + i * row_stride + hh * head_dim;
            float tmp[512];
            for (int64_t d = 0; d < head_dim; d++) tmp[d] = v[d];
            for (int64_t d = 0; d < half; d++) v[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
            for (int64_t d = half; d < head_dim; d++) v[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
        }
    }
}

/* silu(g) = g / (1 + exp(-g)), with exp's argument held at 88 (exp(88) ~ 1.7e38): past ~88.7 it
 * is +inf, and -ffast-math's division (a reciprocal estimate refined by Newton steps) turns
 * g / inf into NaN where IEEE gives -0. Held, a gate below -88 gives g / 1.7e38, as good as 0. */
#define SILU_EXP_MAX 88.f

static inline float silu(float g) { return g / (1.f + expf(fminf(-g, SILU_EXP_MAX))); }

/* out[i] = silu(gu[i][:inter]) * gu[i][inter:]; gu rows are 2 * inter long, out rows inter. */
void silu_mul_f32(const float *gu, float *out, int64_t n, int64_t inter) {
    #pragma omp parallel for if (n >= PAR_ROWS) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *g = gu + i * 2 * inter;
        const float *u = g + inter;
        float *o = out + i * inter;
        for (int64_t d = 0; d < inter; d++) o[d] = silu(g[d]) * u[d];
    }
}

/* Y = X @ W^T for the m rows of X (any m), W packed in panels of PANEL output rows:
 * Wp[p][k][j] = W[p * PANEL + j][k] (engine/layer_ops.py packs it; without AVX-512 each half of
 * a panel is contiguous instead: gemm_half_panels), so each panel is one contiguous stream and
 * no horizontal sum is needed. The micro-kernel takes up to block_rows rows
 * of X against one panel: for each k, the panel's 32 weights (two 16-float vectors) times X[r][k]
 * broadcast, into block_rows x 2 accumulators (16 FMAs for 2 weight loads and 8 broadcasts, so
 * it runs at the FMA units' rate; the panel, reused for every block of rows, stays in L2).
 * Each output is one k-ordered FMA chain, the same whatever m and the row's place in the batch.
 * Work items are (chunk of rows, panel) pairs, chunk-major (chunks of equal size, at most
 * CHUNK_ROWS rows). Without AVX-512 they are cut into one contiguous range per OpenMP thread:
 * a decode batch (one chunk) gives each thread whole panels, each streaming its own part of
 * Wp; a prefill pass gives each thread chunks of rows that stay in its L2 while the panels
 * stream past (a row re-read per panel from L3 otherwise: 1-3% slower at 2,048 rows). With
 * AVX-512 they are dealt out as units (a chunk and a run of its panels, about
 * UNITS_PER_THREAD per thread) to whichever thread is free: on a VM whose cores do not keep
 * one speed, a static split leaves the faster thread waiting at the region's end. Which thread
 * computes an output never changes it.
 * X rows are x_stride apart, Y rows y_stride apart; out_dim is a multiple of PANEL.
 * block_rows (one of BLOCK_ROWS; any other: the first) is how many rows a micro-kernel call
 * takes. With AVX-512 (32 registers of 16 floats) 8 rows take 16 accumulators, as the kernel was
 * tuned on Zen 4, and 12 read each panel from L2 a third less often; without it (AVX2: 16
 * registers of 8 floats, a panel row is 4 of them) the block is 1-4 rows of 8-float vectors
 * (64-byte vectors there are split by the compiler into spills: 25-30x slower), or 6 rows
 * against half a panel (6, `half_rows`). Neither the block nor the vector width changes an
 * output's FMA chain (k in order, one rounding each): the same sums with every block_rows and
 * either build (engine/kernel_choice.py times the blocks per CPU). The gated kernel's SiLU is
 * exp512 with AVX-512 and expf without: its bits differ between the two builds. */
#define PANEL 32
#define MAX_BLOCK_ROWS 12
#define CHUNK_ROWS 256
#define UNITS_PER_THREAD 8
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
#ifdef __AVX512F__
static const int64_t BLOCK_ROWS[] = {8, 4, 12};
#else
static const int64_t BLOCK_ROWS[] = {2, 1, 3, 4, 6};  /* 6: half panels, below */
#endif
#define N_BLOCK_ROWS ((int64_t)(sizeof BLOCK_ROWS / sizeof BLOCK_ROWS[0]))
#define HALF (PANEL / 2)

/* Whether this build reads half panels: 1 without AVX-512, where the panel's 16 left columns
 * for every k come first and its 16 right ones after them (Wp[p][h][k][j] = W[p * PANEL + h * 16
 * + j][k], engine/layer_ops.py packs it so), so the 6x16 block streams one contiguous run; 0
 * with AVX-512, whose block reads both halves of a k at once (Wp[p][k][j]). */
int64_t gemm_half_panels(void) {
#ifdef __AVX512F__
    return 0;
#else
    return 1;
#endif
}

/* The block_rows this build takes, the default first; returns how many (at most `cap` written). */
int64_t gemm_block_rows(int64_t *out, int64_t cap) {
    for (int64_t i = 0; i < N_BLOCK_ROWS && i < cap; i++) out[i] = BLOCK_ROWS[i];
    return N_BLOCK_ROWS;
}

#ifdef __AVX512F__
#include "simd.h"
#endif

/* out[0..15] = silu(g) * u over 16 lanes: g / (1 + exp(-g)) * u, as silu_mul_f32 computes it.
 * (Pointers, not vector arguments: a 64-byte vector passed by value is an ABI question that gcc
 * warns about on machines without AVX-512.) Without AVX-512 it is one function, not inlined:
 * -ffast-math lets the compiler vectorize expf differently where the loop is inlined (libmvec's
 * or the scalar one), and every caller must give the same bits. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void silu_mul16(const v16 *g, const v16 *u, float *out) {
    const __m512 gv = (__m512)*g;
    const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(SILU_EXP_MAX)));
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), (__m512)*u));
}
#else
static __attribute__((noinline)) void silu_mul16(const v16 *g, const v16 *u, float *out) {
    for (int j = 0; j < 16; j++) out[j] = silu((*g)[j]) * (*u)[j];
}
#endif

/* `gated` (a constant where inlined): the panel holds 16 gate rows then the same 16 up rows
 * (engine/layer_ops.py pack_gated_panels), and the block writes silu(gate) * up, 16 columns. */
#ifdef __AVX512F__
/* The accumulators are named variables, not an array: with an array gcc 12 (targeting Intel's
 * AVX-512 cores) kept them in memory and loaded and stored each one every k (as it did for the
 * AVX2 block's last rows, below): 63 GFLOPS on one Emerald Rapids core against ~170 peak. The
 * panel's line PANEL_PREFETCH rows of k ahead is prefetched, 4 KiB as in the AVX2 block (3-5%
 * on Emerald Rapids; 16 or 64 rows no different). */
#define PANEL_PREFETCH 32
static inline __attribute__((always_inline)) void panel_block(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, const int64_t m, float *Y,
        int64_t y_stride, const int gated) {
    v16 a0_0 = {0}, a0_1 = {0}, a1_0 = {0}, a1_1 = {0}, a2_0 = {0}, a2_1 = {0}, a3_0 = {0}, a3_1 = {0};
    v16 a4_0 = {0}, a4_1 = {0}, a5_0 = {0}, a5_1 = {0}, a6_0 = {0}, a6_1 = {0}, a7_0 = {0}, a7_1 = {0};
    v16 a8_0 = {0}, a8_1 = {0}, a9_0 = {0}, a9_1 = {0}, a10_0 = {0}, a10_1 = {0}, a11_0 = {0}, a11_1 = {0};
    for (int64_t k = 0; k < in_dim; k++) {
        v16 w0, w1;
        __builtin_prefetch(w + (k + PANEL_PREFETCH) * PANEL);  /* past the panel's end: a hint, never a fault */
        __builtin_prefetch(w + (k + PANEL_PREFETCH) * PANEL + 16);
        __builtin_memcpy(&w0, w + k * PANEL, sizeof w0);
        __builtin_memcpy(&w1, w + k * PANEL + 16, sizeof w1);
#define ROW(r) if (m > r) { const float xs = X[r * x_stride + k]; a##r##_0 += w0 * xs; a##r##_1 += w1 * xs; }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
    }
#define OUT(r) if (m > r) { \
        if (gated) { \
            silu_mul16(&a##r##_0, &a##r##_1, Y + r * y_stride); \
        } else { \
            __builtin_memcpy(Y + r * y_stride, &a##r##_0, sizeof a##r##_0); \
            __builtin_memcpy(Y + r * y_stride + 16, &a##r##_1, sizeof a##r##_1); \
        } }
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7) OUT(8) OUT(9) OUT(10) OUT(11)
#undef OUT
}
#else
static inline __attribute__((always_inline)) void panel_block(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, const int64_t m, float *Y,
        int64_t y_stride, const int gated) {
    v8 a[MAX_BLOCK_ROWS][4];
    const float *w_hi = w + in_dim * HALF;  /* half panels (see gemm_half_panels) */
    for (int64_t r = 0; r < m; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = (v8){0};
    for (int64_t k = 0; k < in_dim; k++) {
        v8 w0, w1, w2, w3;
        __builtin_memcpy(&w0, w + k * HALF, sizeof w0);
        __builtin_memcpy(&w1, w + k * HALF + 8, sizeof w1);
        __builtin_memcpy(&w2, w_hi + k * HALF, sizeof w2);
        __builtin_memcpy(&w3, w_hi + k * HALF + 8, sizeof w3);
        for (int64_t r = 0; r < m; r++) {
            const float xs = X[r * x_stride + k];
            a[r][0] += w0 * xs;
            a[r][1] += w1 * xs;
            a[r][2] += w2 * xs;
            a[r][3] += w3 * xs;
        }
    }
    for (int64_t r = 0; r < m; r++) {
        if (gated) {
            v16 g, u;
            __builtin_memcpy(&g, &a[r][0], sizeof g);
            __builtin_memcpy(&u, &a[r][2], sizeof u);
            silu_mul16(&g, &u, Y + r * y_stride);
        } else {
            __builtin_memcpy(Y + r * y_stride, a[r], sizeof a[r]);
        }
    }
}
#endif

/* Rows r0.. of X against one panel, `br` at a time (a constant in the AVX-512 cases), while a whole
 * block fits before r1; returns the first row left. */
static inline __attribute__((always_inline)) int64_t panel_rows(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, int64_t r0, int64_t r1, float *Y,
        int64_t y_stride, const int gated, const int br) {
    int64_t r = r0;
    for (; r + br <= r1; r += br)
        panel_block(w, in_dim, X + r * x_stride, x_stride, br, Y + r * y_stride, y_stride, gated);
    return r;
}

/* The last r1 - r rows (fewer than a block), their count made a constant (a switch) so their
 * accumulators stay in registers too. */
static inline __attribute__((always_inline)) void panel_tail(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, int64_t r, int64_t r1, float *Y,
        int64_t y_stride, const int gated) {
    X += r * x_stride;
    Y += r * y_stride;
#define TAIL(n) case n: panel_block(w, in_dim, X, x_stride, n, Y, y_stride, gated); break;
    switch (r1 - r) {
        case 0: break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10)
        default: panel_block(w, in_dim, X, x_stride, 11, Y, y_stride, gated); break;
    }
#undef TAIL
}

#ifndef __AVX512F__
/* Without AVX-512, many rows against half a panel (16 columns: 2 registers) at a time: m x 2
 * accumulators, m <= 6 (12 of the 16 registers, 2 for the weights, 1 for the broadcast), the
 * Haswell-style 6x16 block. Out rows are out_stride apart; 16 raw sums each. A half panel is
 * one contiguous run (gemm_half_panels; read as every other line of whole panels it ran a few
 * percent slower), and the line HALF_PREFETCH rows of k ahead is prefetched: 4 KiB, about a
 * memory read's latency at the block's pace (the weights come from memory in a forward pass;
 * docs/BENCHMARKS.md, "Prefill attention by KV head, decode attention by sequence"). The
 * accumulators are named variables, not an array: with an array gcc kept those of 1-3 row
 * blocks (a batch's last rows) in memory, and such a block took longer than a full one
 * (docs/BENCHMARKS.md, "The linears' last rows"). */
#define HALF_PREFETCH 64
static inline __attribute__((always_inline)) void half_block(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, const int64_t m, float *out,
        int64_t out_stride) {
    v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
    v8 a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
    for (int64_t k = 0; k < in_dim; k++) {
        v8 w0, w1;
        __builtin_prefetch(w + (k + HALF_PREFETCH) * HALF);  /* past the panel's end: a hint, never a fault */
        __builtin_memcpy(&w0, w + k * HALF, sizeof w0);
        __builtin_memcpy(&w1, w + k * HALF + 8, sizeof w1);
#define ROW(r) if (m > r) { const float xs = X[r * x_stride + k]; a##r##0 += w0 * xs; a##r##1 += w1 * xs; }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
#define OUT(r) if (m > r) { __builtin_memcpy(out + r * out_stride, &a##r##0, sizeof a##r##0); \
                            __builtin_memcpy(out + r * out_stride + 8, &a##r##1, sizeof a##r##1); }
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
#undef OUT
}

/* m (a constant where inlined) rows against both halves of one panel; gated: silu(gate) * up. */
static inline __attribute__((always_inline)) void halves(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, const int64_t m, float *Y,
        int64_t y_stride, const int gated) {
    if (!gated) {
        half_block(w, in_dim, X, x_stride, m, Y, y_stride);
        half_block(w + in_dim * HALF, in_dim, X, x_stride, m, Y + HALF, y_stride);
        return;
    }
    v16 g[6], u[6];
    half_block(w, in_dim, X, x_stride, m, (float *)g, 16);
    half_block(w + in_dim * HALF, in_dim, X, x_stride, m, (float *)u, 16);
    for (int64_t r = 0; r < m; r++) silu_mul16(&g[r], &u[r], Y + r * y_stride);
}

static inline __attribute__((always_inline)) void half_rows(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, int64_t r0, int64_t r1, float *Y,
        int64_t y_stride, const int gated) {
    int64_t r = r0;
    for (; r + 6 <= r1; r += 6) halves(w, in_dim, X + r * x_stride, x_stride, 6, Y + r * y_stride, y_stride, gated);
    X += r * x_stride;
    Y += r * y_stride;
#define TAIL(n) case n: halves(w, in_dim, X, x_stride, n, Y, y_stride, gated); break;
    switch (r1 - r) {
        case 0: break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4)
        default: halves(w, in_dim, X, x_stride, 5, Y, y_stride, gated); break;
    }
#undef TAIL
}
#endif

#ifdef __AVX512F__
/* Rows r0..r1 against panels g0..g1, `br` rows at a time (a constant). */
static inline __attribute__((always_inline)) void range_rows(
        const float *Wp, int64_t in_dim, int64_t g0, int64_t g1, const float *X, int64_t x_stride, int64_t r0,
        int64_t r1, float *Y, int64_t y_stride, int64_t y_cols, const int gated, const int br) {
    for (int64_t p = g0; p < g1; p++) {
        const float *w = Wp + p * in_dim * PANEL;
        float *y = Y + p * y_cols;
        const int64_t r = panel_rows(w, in_dim, X, x_stride, r0, r1, y, y_stride, gated, br);
        panel_tail(w, in_dim, X, x_stride, r, r1, y, y_stride, gated);
    }
}
#endif

/* block_rows (br): one of BLOCK_ROWS (any other, 0 included: the default, the first). */
static void gemm(
        const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m, float *Y,
        int64_t y_stride, const int gated, int br) {
    int known = 0;
    for (int64_t i = 0; i < N_BLOCK_ROWS; i++) known |= br == BLOCK_ROWS[i];
    if (!known) br = (int)BLOCK_ROWS[0];  /* a 0-row block would never advance */
    const int64_t panels = out_dim / PANEL, chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t items = panels * chunks, y_cols = gated ? PANEL / 2 : PANEL;
    /* the rows cut into chunks of equal size (a multiple of 6 rows, the AVX2 block), so equal
     * shares of items are equal shares of the work */
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + 5) / 6 * 6;
#ifdef __AVX512F__
    int64_t unit = items / (UNITS_PER_THREAD * omp_get_max_threads());  /* panels per unit */
    if (unit < 1) unit = 1;
    if (unit > panels) unit = panels;
    const int64_t per_chunk = (panels + unit - 1) / unit, units = per_chunk * chunks;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t c = u / per_chunk, g0 = u % per_chunk * unit, g1 = g0 + unit < panels ? g0 + unit : panels;
        const int64_t r0 = c * chunk_rows, r1 = r0 + chunk_rows < m ? r0 + chunk_rows : m;
        /* gcc outlines the parallel region before it inlines, so br is a run-time value in it:
         * each case names its row count, else the one block compiled for every br tests each
         * row's `m > r` every k, and kept the accumulators in memory. */
#define ROWS(n) case n: range_rows(Wp, in_dim, g0, g1, X, x_stride, r0, r1, Y, y_stride, y_cols, gated, n); break;
        switch (br) {
            ROWS(4) ROWS(12)
            default: range_rows(Wp, in_dim, g0, g1, X, x_stride, r0, r1, Y, y_stride, y_cols, gated, 8); break;
        }
#undef ROWS
    }
#else
    #pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t i = items * t / nt; i < items * (t + 1) / nt; i++) {
            const int64_t p = i % panels, r0 = i / panels * chunk_rows;
            const int64_t r1 = r0 + chunk_rows < m ? r0 + chunk_rows : m;
            const float *w = Wp + p * in_dim * PANEL;
            float *y = Y + p * y_cols;
            int64_t r = r0;
            /* AVX2: the 1-4 row blocks stay one block for every br (their accumulators fit in
             * registers either way): named per case, 4 rows ran 12-15% slower, and the 6-row
             * half-panel path beside them 5-7% slower (timed on Emerald Rapids' AVX2). */
            if (br == 6) {
                half_rows(w, in_dim, X, x_stride, r0, r1, y, y_stride, gated);
                continue;
            }
            r = panel_rows(w, in_dim, X, x_stride, r0, r1, y, y_stride, gated, br);
            panel_tail(w, in_dim, X, x_stride, r, r1, y, y_stride, gated);
        }
    }
#endif
}

void gemm_f32(const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m,
              float *Y, int64_t y_stride, int64_t block_rows) {
    gemm(Wp, out_dim, in_dim, X, x_stride, m, Y, y_stride, 0, (int)block_rows);
}

/* The MLP's input half fused: Y [m, out_dim / 2] = silu(X @ gate^T) * (X @ up^T), from gated panels. */
void gemm_silu_f32(const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m,
                   float *Y, int64_t y_stride, int64_t block_rows) {
    gemm(Wp, out_dim, in_dim, X, x_stride, m, Y, y_stride, 1, (int)block_rows);
}
