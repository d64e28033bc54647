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
    return 1.f / sqrtf(ss / (float)dim + eps);
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
 * Wp[p][k][j] = W[p * PANEL + j][k] (engine/layer_ops.py packs it), so each panel is one
 * contiguous stream and no horizontal sum is needed. The micro-kernel takes up to BLOCK_ROWS rows
 * of X against one panel: for each k, the panel's 32 weights (two 16-float vectors) times X[r][k]
 * broadcast, into BLOCK_ROWS x 2 accumulators (16 FMAs for 2 weight loads and 8 broadcasts, so
 * it runs at the FMA units' rate; the panel, reused for every block of rows, stays in L2).
 * Each output is one k-ordered FMA chain, the same whatever m and the row's place in the batch.
 * Work items are (CHUNK_ROWS rows, panel) pairs, chunk-major, cut into one contiguous range per
 * OpenMP thread: a decode batch (one chunk) gives each thread whole panels, each streaming its
 * own part of Wp; a prefill pass gives each thread chunks of rows that stay in its L2 while the
 * panels stream past (a row re-read per panel from L3 otherwise: 1-3% slower at 2,048 rows).
 * X rows are x_stride apart, Y rows y_stride apart; out_dim is a multiple of PANEL. */
#define PANEL 32
#define BLOCK_ROWS 8
#define CHUNK_ROWS 256
typedef float v16 __attribute__((vector_size(64)));

#ifdef __AVX512F__
#include "simd.h"
#endif

/* out[0..15] = silu(g) * u over 16 lanes: g / (1 + exp(-g)) * u, as silu_mul_f32 computes it.
 * (Pointers, not vector arguments: a 64-byte vector passed by value is an ABI question that gcc
 * warns about on machines without AVX-512.) */
static inline __attribute__((always_inline)) void silu_mul16(const v16 *g, const v16 *u, float *out) {
#ifdef __AVX512F__
    const __m512 gv = (__m512)*g;
    const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(SILU_EXP_MAX)));
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), (__m512)*u));
#else
    for (int j = 0; j < 16; j++) out[j] = silu((*g)[j]) * (*u)[j];
#endif
}

/* `gated` (a constant where inlined): the panel holds 16 gate rows then the same 16 up rows
 * (engine/layer_ops.py pack_gated_panels), and the block writes silu(gate) * up, 16 columns. */
static inline __attribute__((always_inline)) void panel_block(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, const int64_t m, float *Y,
        int64_t y_stride, const int gated) {
    v16 a0[BLOCK_ROWS], a1[BLOCK_ROWS];
    for (int64_t r = 0; r < m; r++) a0[r] = a1[r] = (v16){0};
    for (int64_t k = 0; k < in_dim; k++) {
        v16 w0, w1;
        __builtin_memcpy(&w0, w + k * PANEL, sizeof w0);
        __builtin_memcpy(&w1, w + k * PANEL + 16, sizeof w1);
        for (int64_t r = 0; r < m; r++) {
            const float xs = X[r * x_stride + k];
            a0[r] += w0 * xs;
            a1[r] += w1 * xs;
        }
    }
    for (int64_t r = 0; r < m; r++) {
        if (gated) {
            silu_mul16(&a0[r], &a1[r], Y + r * y_stride);
        } else {
            __builtin_memcpy(Y + r * y_stride, &a0[r], sizeof a0[r]);
            __builtin_memcpy(Y + r * y_stride + 16, &a1[r], sizeof a1[r]);
        }
    }
}

/* Rows r0..r1 of X against one panel, BLOCK_ROWS at a time; the tail's row count is made a
 * constant (a switch) so its accumulators stay in registers too. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *w, int64_t in_dim, const float *X, int64_t x_stride, int64_t r0, int64_t r1, float *Y,
        int64_t y_stride, const int gated) {
    int64_t r = r0;
    for (; r + BLOCK_ROWS <= r1; r += BLOCK_ROWS)
        panel_block(w, in_dim, X + r * x_stride, x_stride, BLOCK_ROWS, Y + r * y_stride, y_stride, gated);
    X += r * x_stride;
    Y += r * y_stride;
    switch (r1 - r) {
        case 0: break;
        case 1: panel_block(w, in_dim, X, x_stride, 1, Y, y_stride, gated); break;
        case 2: panel_block(w, in_dim, X, x_stride, 2, Y, y_stride, gated); break;
        case 3: panel_block(w, in_dim, X, x_stride, 3, Y, y_stride, gated); break;
        case 4: panel_block(w, in_dim, X, x_stride, 4, Y, y_stride, gated); break;
        case 5: panel_block(w, in_dim, X, x_stride, 5, Y, y_stride, gated); break;
        case 6: panel_block(w, in_dim, X, x_stride, 6, Y, y_stride, gated); break;
        default: panel_block(w, in_dim, X, x_stride, 7, Y, y_stride, gated); break;
    }
}

static inline __attribute__((always_inline)) void gemm(
        const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m, float *Y,
        int64_t y_stride, const int gated) {
    const int64_t panels = out_dim / PANEL, chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t items = panels * chunks, y_cols = gated ? PANEL / 2 : PANEL;
    #pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t i = items * t / nt; i < items * (t + 1) / nt; i++) {
            const int64_t p = i % panels, r0 = i / panels * CHUNK_ROWS;
            const int64_t r1 = r0 + CHUNK_ROWS < m ? r0 + CHUNK_ROWS : m;
            panel_rows(Wp + p * in_dim * PANEL, in_dim, X, x_stride, r0, r1, Y + p * y_cols, y_stride, gated);
        }
    }
}

void gemm_f32(const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m,
              float *Y, int64_t y_stride) {
    gemm(Wp, out_dim, in_dim, X, x_stride, m, Y, y_stride, 0);
}

/* The MLP's input half fused: Y [m, out_dim / 2] = silu(X @ gate^T) * (X @ up^T), from gated panels. */
void gemm_silu_f32(const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m,
                   float *Y, int64_t y_stride) {
    gemm(Wp, out_dim, in_dim, X, x_stride, m, Y, y_stride, 1);
}
