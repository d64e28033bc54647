/* The elementwise steps of a decoder layer on CPU, fused (float32): each is one pass over its
 * rows instead of 3-6 torch ops, which at decode batch sizes are dominated by per-op dispatch,
 * not by the arithmetic. Rows are spread over torch's OpenMP threads when there are enough of
 * them to pay for a parallel region (prefill chunks); a decode step's few rows run on the
 * calling thread.
 *
 * Numerics: the same formulas as engine/model.py's torch path (RMSNorm in float32,
 * x * rsqrt(mean(x^2) + eps) * w; RoPE x * cos + roll(x) * sin_signed; silu(g) * u); the sums run
 * in a different order, so results agree to float32 rounding, not to the bit.
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

/* out[i] = silu(gu[i][:inter]) * gu[i][inter:]; gu rows are 2 * inter long, out rows inter. */
void silu_mul_f32(const float *gu, float *out, int64_t n, int64_t inter) {
    #pragma omp parallel for if (n >= PAR_ROWS) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *g = gu + i * 2 * inter;
        const float *u = g + inter;
        float *o = out + i * inter;
        for (int64_t d = 0; d < inter; d++) o[d] = g[d] / (1.f + expf(-g[d])) * u[d];
    }
}

/* Y[r] = W @ X[r] for the m rows of X (m <= GEMV_MAX_ROWS: a decode batch), W packed in panels of
 * GEMV_PANEL output rows: Wp[p][k][j] = W[p * GEMV_PANEL + j][k] (engine/layer_ops.py packs it),
 * so each panel is one contiguous stream and no horizontal sum is needed: for each k, the
 * panel's 32 weights (two 16-float vectors) are multiplied by X[r][k] broadcast into m x 2
 * accumulators. Panels are split over the OpenMP threads. At decode batch sizes a linear is
 * bound by reading its weights; this streams them at close to the memory's bandwidth. X rows
 * are x_stride apart, Y rows y_stride apart; out_dim is a multiple of GEMV_PANEL. */
#define GEMV_MAX_ROWS 8
#define GEMV_PANEL 32
typedef float v16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) void gemv_panels(
        const float *Wp, int64_t p0, int64_t p1, int64_t in_dim, const float *X, int64_t x_stride,
        const int64_t m, float *Y, int64_t y_stride) {
    for (int64_t p = p0; p < p1; p++) {
        const float *w = Wp + p * in_dim * GEMV_PANEL;
        v16 a0[GEMV_MAX_ROWS], a1[GEMV_MAX_ROWS];
        for (int64_t r = 0; r < m; r++) a0[r] = a1[r] = (v16){0};
        for (int64_t k = 0; k < in_dim; k++) {
            v16 w0, w1;
            __builtin_memcpy(&w0, w + k * GEMV_PANEL, sizeof w0);
            __builtin_memcpy(&w1, w + k * GEMV_PANEL + 16, sizeof w1);
            for (int64_t r = 0; r < m; r++) {
                const float xs = X[r * x_stride + k];
                a0[r] += w0 * xs;
                a1[r] += w1 * xs;
            }
        }
        for (int64_t r = 0; r < m; r++) {
            __builtin_memcpy(Y + r * y_stride + p * GEMV_PANEL, &a0[r], sizeof a0[r]);
            __builtin_memcpy(Y + r * y_stride + p * GEMV_PANEL + 16, &a1[r], sizeof a1[r]);
        }
    }
}

void gemv_f32(const float *Wp, int64_t out_dim, int64_t in_dim, const float *X, int64_t x_stride, int64_t m,
              float *Y, int64_t y_stride) {
    const int64_t panels = out_dim / GEMV_PANEL;
    #pragma omp parallel
    {
        /* Contiguous panel ranges per thread: each streams its own part of Wp. */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        switch (m) {
            case 1: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 1, Y, y_stride); break;
            case 2: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 2, Y, y_stride); break;
            case 3: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 3, Y, y_stride); break;
            case 4: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 4, Y, y_stride); break;
            case 5: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 5, Y, y_stride); break;
            case 6: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 6, Y, y_stride); break;
            case 7: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 7, Y, y_stride); break;
            default: gemv_panels(Wp, p0, p1, in_dim, X, x_stride, 8, Y, y_stride); break;
        }
    }
}
