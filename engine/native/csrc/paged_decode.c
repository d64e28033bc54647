/* Paged decode attention on CPU, reading K/V where they lie in the paged cache.
 *
 * One query token per sequence (a decode step), over the sequence's keys, its new token's
 * included. K/V are read once, in place, never copied into a workspace.
 *
 * Layout (engine/kv_cache.py): element (block b, token t, kv head h, dim d) of layer L's K is at
 *   base + b * block_stride + L * layer_stride + t * token_stride + h * head_dim + d,
 * and V is `v_offset` elements further. All strides are in elements (float32).
 * q: [tokens, heads, head_dim] with row stride q_stride; out: [tokens, heads, head_dim] contiguous.
 * Work items (sequence, KV head), or whole sequences (given many), are spread over the OpenMP
 * threads (torch's own runtime: the library is loaded into a process that already holds
 * torch's libgomp).
 *
 * Two implementations of one item. `attend_tiles` (AVX-512, or AVX2 with FMA; head_dim 64,
 * groups of up to 16 query heads, any block size) computes each query head as paged_prefill.c
 * computes a prompt row at the same position: the same 32-key tiles, products, running max and
 * sums and weighted-V order, so a token decoded here gets the bits of the same token prefilled (a multi-turn
 * prompt's earlier answer, cached or pulled from the node that decoded it, is the answer
 * prefilled; tests/engine/test_prefill_kernel.py). The portable `attend_one` (auto-vectorised
 * C) takes everything else, close to the prefill path's SDPA, not equal to it.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

/* One (sequence, KV head). Inlined into callers with constant head_dim / group, so the common
 * shapes get fixed trip counts (unrolled, vectorized loops); exp is libmvec's vector expf
 * (-ffast-math), which is why no infinity is used: the running max starts at the first block's. */
static inline __attribute__((always_inline)) void attend_one(
        const float *base, int64_t block_stride, int64_t layer_offset, int64_t v_offset, int64_t token_stride,
        const float *qs, float *o, const int64_t *table, int64_t ctx, int64_t h, int64_t group, int64_t head_dim,
        int64_t block_size, float scale) {
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float sc[MAX_GROUP][MAX_BLOCK];
    float qv[MAX_GROUP][MAX_HEAD_DIM];
    for (int64_t g = 0; g < group; g++) {
        l[g] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            acc[g][d] = 0.f;
            qv[g][d] = qs[g * head_dim + d] * scale;
        }
    }
    for (int64_t j = 0; j * block_size < ctx; j++) {
        const int64_t n = ctx - j * block_size < block_size ? ctx - j * block_size : block_size;
        const float *kb = base + table[j] * block_stride + layer_offset + h * head_dim;
        const float *vb = kb + v_offset;
        for (int64_t t = 0; t < n; t++) {
            const float *k = kb + t * token_stride;
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.f;
                for (int64_t d = 0; d < head_dim; d++) dot += qv[g][d] * k[d];
                sc[g][t] = dot;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float bm = sc[g][0];
            for (int64_t t = 1; t < n; t++) bm = sc[g][t] > bm ? sc[g][t] : bm;
            float c = 0.f;
            if (j == 0) {
                m[g] = bm;
            } else if (bm > m[g]) {
                c = expf(m[g] - bm);
                m[g] = bm;
            } else {
                c = 1.f;
            }
            const float mg = m[g];
            float sum = 0.f;
            for (int64_t t = 0; t < n; t++) {
                const float p = expf(sc[g][t] - mg);
                sc[g][t] = p;
                sum += p;
            }
            if (j > 0 && c != 1.f) {
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= c;
            }
            l[g] = (j == 0 ? 0.f : l[g] * c) + sum;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *v = vb + t * token_stride;
            for (int64_t g = 0; g < group; g++) {
                const float p = sc[g][t];
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * v[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < head_dim; d++) o[g * head_dim + d] = acc[g][d] * inv;
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "simd.h"

#define HD 64            /* the head size the tiled kernel takes (paged_prefill.c's) */
#define KT 32            /* keys per tile: paged_prefill.c's */
#define CHUNK_TILES 32   /* tiles of one KV head scored before their softmax and V pass: 1,024 keys */
#define MAX_ROWS 16      /* query heads an item takes: its KV heads' groups together */
#define SLICE 4          /* query heads scored (and weighted) together against a tile */

/* The rows of tile k0's n (1..32) keys (K; V lies v_offset further; the KV heads side by side).
 * The slots past n point at the first key's row: the scores load every slot (and mask those past
 * n), so each must be a row of the context; keys past the context are never read. One division
 * a tile. */
static inline void tile_rows(const float *kbase, const int64_t *table, int64_t block_stride, int64_t token_stride,
                             int64_t block_size, int64_t k0, int n, const float **row) {
    int64_t b = k0 / block_size, t = k0 % block_size;
    for (int j = 0; j < n; j++) {
        row[j] = kbase + table[b] * block_stride + t * token_stride;
        if (++t == block_size) {
            t = 0;
            b++;
        }
    }
    for (int j = n; j < KT; j++) row[j] = row[0];
}
#endif

#ifdef __AVX512F__
/* r[0..15] (16 rows of 16) transposed in registers: r[i][j] becomes r[j][i]. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

/* Scores of R (<= SLICE) query heads (qa: scaled, rows of 64) against one KV head's keys of a
 * tile (rows row[j] + hoff), into sc[i * stride ..][0..32): paged_prefill.c's fold_tile
 * products, one FMA chain over the head dimension per key, d ascending. The keys are
 * transposed in registers, 16 keys x 16 dimensions at a time, into the prefill's packed
 * layout (a vector of 16 keys per dimension). Meanwhile the tile's V rows (+ voff) and the
 * rows at next[0..32) + noff are prefetched into L2, spread over the loop. */
static inline __attribute__((always_inline)) void score_tile(const float *const *row, int64_t hoff, const float *qa,
                                                             int R, float *sc, int64_t stride,
                                                             const float *const *next, int64_t noff, int64_t voff) {
    __m512 s[2][SLICE];  /* keys 0-15 and 16-31: two halves' chains, interleaved */
    for (int i = 0; i < R; i++) s[0][i] = s[1][i] = _mm512_setzero_ps();
    for (int c = 0; c < HD; c += 16)
        for (int h = 0; h < 2; h++) {
            const int k = h * 4 + c / 16;  /* 8 steps, 4 rows of each prefetch a step */
            if (next)
                for (int t = 0; t < 4; t++)
                    for (int l = 0; l < HD; l += 16) {
                        _mm_prefetch((const char *)(next[k * 4 + t] + noff + l), _MM_HINT_T1);
                        _mm_prefetch((const char *)(row[k * 4 + t] + voff + l), _MM_HINT_T1);
                    }
            __m512 r[16];
            for (int t = 0; t < 16; t++) r[t] = _mm512_loadu_ps(row[h * 16 + t] + hoff + c);
            transpose16(r);
            for (int d = 0; d < 16; d++)
                for (int i = 0; i < R; i++) s[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(qa[i * HD + c + d]), r[d], s[h][i]);
        }
    for (int i = 0; i < R; i++) {
        _mm512_store_ps(sc + i * stride, s[0][i]);
        _mm512_store_ps(sc + i * stride + 16, s[1][i]);
    }
}

/* A tile's scores of nr rows (sc[r * stride ..], n keys valid) folded into their running max
 * and sums as fold_tile folds them: the scores become probabilities in place, and the rows'
 * factors exp(old max - new max) go to alpha[0..nr). lv: the rows' 16-lane sums. */
static inline __attribute__((always_inline)) void softmax_tile(float *sc, int64_t stride, int nr, int n, float *mx,
                                                               float (*lv)[16], float *alpha) {
    const __m512 lo = _mm512_set1_ps(-3.0e38f);
    const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= KT ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
    float nmx[MAX_ROWS] __attribute__((aligned(64)));
    for (int r = 0; r < nr; r++) {
        __m512 s0 = _mm512_load_ps(sc + r * stride), s1 = _mm512_load_ps(sc + r * stride + 16);
        if (n < KT) {
            s0 = _mm512_mask_mov_ps(lo, m0, s0);
            s1 = _mm512_mask_mov_ps(lo, m1, s1);
        }
        const float tmax = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
        nmx[r] = tmax > mx[r] ? tmax : mx[r];
    }
    for (int r = nr; r < MAX_ROWS; r++) nmx[r] = mx[r];
    _mm512_storeu_ps(alpha, exp512(_mm512_sub_ps(_mm512_loadu_ps(mx), _mm512_load_ps(nmx))));
    for (int r = 0; r < nr; r++) {
        mx[r] = nmx[r];
        const __m512 nmv = _mm512_set1_ps(nmx[r]);
        /* lanes past n: zeroed after the exp (the prefill's masked lanes are too) */
        const __m512 s0 = _mm512_load_ps(sc + r * stride), s1 = _mm512_load_ps(sc + r * stride + 16);
        const __m512 e0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(s0, nmv)));
        const __m512 e1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(s1, nmv)));
        _mm512_store_ps(lv[r], _mm512_fmadd_ps(_mm512_load_ps(lv[r]), _mm512_set1_ps(alpha[r]), _mm512_add_ps(e0, e1)));
        _mm512_store_ps(sc + r * stride, e0);
        _mm512_store_ps(sc + r * stride + 16, e1);
    }
}

/* R (<= SLICE) rows' weighted V over a tile's nk keys (rows row[j] + voff), as fold_tile's pv4:
 * acc = acc * alpha, then one FMA per key in key order. */
static inline __attribute__((always_inline)) void weigh_rows(const float *p, int64_t stride, int R,
                                                             const float *const *row, int64_t voff, int nk,
                                                             float *acc, const float *alpha,
                                                             const float *const *next, int64_t noff) {
    __m512 a[SLICE][4];
    for (int i = 0; i < R; i++) {
        const __m512 f = _mm512_set1_ps(alpha[i]);
        for (int c = 0; c < 4; c++) a[i][c] = _mm512_mul_ps(_mm512_load_ps(acc + i * HD + c * 16), f);
    }
    for (int j = 0; j < nk; j++) {
        __m512 v0, v1, v2, v3;
        if (next)
            for (int l = 0; l < HD; l += 16) _mm_prefetch((const char *)(next[j] + noff + l), _MM_HINT_T1);
        load_row64(row[j] + voff, &v0, &v1, &v2, &v3);
        for (int i = 0; i < R; i++) {
            const __m512 w = _mm512_set1_ps(p[i * stride + j]);
            a[i][0] = _mm512_fmadd_ps(w, v0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(w, v1, a[i][1]);
            a[i][2] = _mm512_fmadd_ps(w, v2, a[i][2]);
            a[i][3] = _mm512_fmadd_ps(w, v3, a[i][3]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(acc + i * HD + c * 16, a[i][c]);
}

/* Row r's weighted V divided by its sum, into dst: fold_tile's store_row. */
static inline void store_out(const float *acc, const float *lv, float *dst) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(lv)));
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(acc + c * 16), inv));
}

#elif defined(__AVX2__) && defined(__FMA__)
/* r[0..7] (8 rows of 8) transposed in registers. */
static inline __attribute__((always_inline)) void transpose8(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* As the AVX-512 score_tile, 8 keys x 8 dimensions at a time (32 steps, one row of each
 * prefetch a step). */
static inline __attribute__((always_inline)) void score_tile(const float *const *row, int64_t hoff, const float *qa,
                                                             int R, float *sc, int64_t stride,
                                                             const float *const *next, int64_t noff, int64_t voff) {
    for (int h = 0; h < KT; h += 8) {
        __m256 s[SLICE];
        for (int i = 0; i < R; i++) s[i] = _mm256_setzero_ps();
        for (int c = 0; c < HD; c += 8) {
            const int k = h + c / 8;
            if (next)
                for (int l = 0; l < HD; l += 16) {
                    _mm_prefetch((const char *)(next[k] + noff + l), _MM_HINT_T1);
                    _mm_prefetch((const char *)(row[k] + voff + l), _MM_HINT_T1);
                }
            __m256 r[8];
            for (int t = 0; t < 8; t++) r[t] = _mm256_loadu_ps(row[h + t] + hoff + c);
            transpose8(r);
            for (int d = 0; d < 8; d++)
                for (int i = 0; i < R; i++)
                    s[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(qa + i * HD + c + d), r[d], s[i]);
        }
        for (int i = 0; i < R; i++) _mm256_store_ps(sc + i * stride + h, s[i]);
    }
}

/* As the AVX-512 softmax_tile, in the AVX2 fold_tile's order (8-lane sums: (e0 + e1) + (e2 + e3)). */
static inline __attribute__((always_inline)) void softmax_tile(float *sc, int64_t stride, int nr, int n, float *mx,
                                                               float (*lv)[8], float *alpha) {
    const __m256 lo = _mm256_set1_ps(-3.0e38f);
    __m256 mk[4];
    for (int c = 0; c < 4; c++)
        mk[c] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - c * 8),
                                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    float nmx[MAX_ROWS] __attribute__((aligned(32)));
    for (int r = 0; r < nr; r++) {
        float *s = sc + r * stride;
        __m256 v[4];
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_load_ps(s + c * 8);
            if (n < KT) {
                v[c] = _mm256_blendv_ps(lo, v[c], mk[c]);
                _mm256_store_ps(s + c * 8, v[c]);
            }
        }
        const float tmax = hmax256(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
        nmx[r] = tmax > mx[r] ? tmax : mx[r];
    }
    for (int r = nr; r < MAX_ROWS; r++) nmx[r] = mx[r];
    for (int r = 0; r < MAX_ROWS; r += 8)
        _mm256_storeu_ps(alpha + r, exp256(_mm256_sub_ps(_mm256_loadu_ps(mx + r), _mm256_load_ps(nmx + r))));
    for (int r = 0; r < nr; r++) {
        float *s = sc + r * stride;
        mx[r] = nmx[r];
        const __m256 nmv = _mm256_set1_ps(nmx[r]);
        __m256 e[4];
        for (int c = 0; c < 4; c++) {
            e[c] = _mm256_and_ps(mk[c], exp256(_mm256_sub_ps(_mm256_load_ps(s + c * 8), nmv)));
            _mm256_store_ps(s + c * 8, e[c]);
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3]));
        _mm256_store_ps(lv[r], _mm256_fmadd_ps(_mm256_load_ps(lv[r]), _mm256_set1_ps(alpha[r]), sum));
    }
}

/* As the AVX-512 weigh_rows, a half of the head dimension at a time (12 sums in registers). */
static inline __attribute__((always_inline)) void weigh_rows(const float *p, int64_t stride, int R,
                                                             const float *const *row, int64_t voff, int nk,
                                                             float *acc, const float *alpha,
                                                             const float *const *next, int64_t noff) {
    for (int half = 0; half < HD; half += 32) {
        __m256 a[SLICE][4];
        for (int i = 0; i < R; i++) {
            const __m256 f = _mm256_set1_ps(alpha[i]);
            for (int c = 0; c < 4; c++) a[i][c] = _mm256_mul_ps(_mm256_load_ps(acc + i * HD + half + c * 8), f);
        }
        for (int j = 0; j < nk; j++) {
            const float *v = row[j] + voff + half;
            if (next) {
                _mm_prefetch((const char *)(next[j] + noff + half), _MM_HINT_T1);
                _mm_prefetch((const char *)(next[j] + noff + half + 16), _MM_HINT_T1);
            }
            for (int c = 0; c < 4; c++) {
                const __m256 x = _mm256_loadu_ps(v + c * 8);
                for (int i = 0; i < R; i++)
                    a[i][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * stride + j), x, a[i][c]);
            }
        }
        for (int i = 0; i < R; i++)
            for (int c = 0; c < 4; c++) _mm256_store_ps(acc + i * HD + half + c * 8, a[i][c]);
    }
}

static inline void store_out(const float *acc, const float *lv, float *dst) {
    const __m256 inv = _mm256_set1_ps(1.f / hsum256(_mm256_load_ps(lv)));
    for (int c = 0; c < HD; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_load_ps(acc + c), inv));
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif

/* Slices of one KV head's `group` query heads, SLICE at a time, with R a constant in each call
 * (so the register arrays stay in registers). */
#define BY_SLICE(group, CALL)                                                \
    for (int r0 = 0; r0 < (group); r0 += SLICE) {                            \
        switch ((group) - r0 < SLICE ? (group) - r0 : SLICE) {               \
        case 1: CALL(1); break;                                              \
        case 2: CALL(2); break;                                              \
        case 3: CALL(3); break;                                              \
        default: CALL(4); break;                                             \
        }                                                                    \
    }

/* One item: KV heads h0 .. h0 + nh - 1 of one sequence (kbase: the layer's K, head 0), their
 * group query heads each (qs / o: the item's first query head's row; nh * group <= MAX_ROWS).
 * Each query head's arithmetic is paged_prefill.c's for a prompt row at the same position
 * (its 32-key tiles, products, running max and sums, weighted V order, final division), so a
 * token decoded here gets the attention output of the same token prefilled, to the bit (and so
 * the same K/V in the layers after). Two passes a chunk of CHUNK_TILES / nh tiles: every score
 * first (keys transposed in registers into the prefill's tile layout), then the tiles' softmax
 * in order, then the weighted V; the heads take each tile in turn, so a block's rows (all KV
 * heads side by side) are read whole. */
static void attend_tiles(const float *kbase, int64_t v_offset, int64_t block_stride, int64_t token_stride,
                         int64_t block_size, const int64_t *table, int64_t ctx, const float *qs, float *o,
                         float scale, int group, int nh) {
    const int nr = group * nh;
    float qa[MAX_ROWS][HD] __attribute__((aligned(64))), acc[MAX_ROWS][HD] __attribute__((aligned(64)));
    float lv[MAX_ROWS][LANES] __attribute__((aligned(64)));
    float mx[MAX_ROWS] __attribute__((aligned(64)));
    float alpha[CHUNK_TILES][MAX_ROWS] __attribute__((aligned(64)));
    float sc[MAX_ROWS][CHUNK_TILES * KT] __attribute__((aligned(64)));
    for (int r = 0; r < MAX_ROWS; r++) mx[r] = -3.0e38f;
    for (int r = 0; r < nr; r++) {
        for (int d = 0; d < HD; d++) {
            qa[r][d] = qs[r * HD + d] * scale;
            acc[r][d] = 0.f;
        }
        for (int l = 0; l < LANES; l++) lv[r][l] = 0.f;
    }
    /* Rows of the tile at hand and of the one after, prefetched into L2 meanwhile: while scoring,
     * the next tile's K and this tile's V (read again after the chunk's softmax), the chunk's
     * first V after its last K; while weighing, the next tile's V, the next chunk's first K after
     * the chunk's last V. L2 hints: with L1 ones the prefetches stalled on the misses in flight
     * (docs/BENCHMARKS.md, "Decode attention in the prefill's order"). */
    const float *rows[2][KT];
    const int64_t tiles = (ctx + KT - 1) / KT;
#define TILE_N(tile) (ctx - (tile) * KT < KT ? (int)(ctx - (tile) * KT) : KT)
#define ROWS(tile, dst) tile_rows(kbase, table, block_stride, token_stride, block_size, (tile) * KT, TILE_N(tile), dst)
    ROWS(0, rows[0]);
    /* a chunk's K and V stay in L2 for its passes: 1,024 keys of one KV head (256 KB each) */
    const int chunk = CHUNK_TILES / nh;
    for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
        const int nt = tiles - t0 < chunk ? (int)(tiles - t0) : chunk;
        for (int tt = 0; tt < nt; tt++) {
            const float **row = rows[tt & 1], **next = rows[(tt + 1) & 1];
            const int last = tt + 1 == nt;
            ROWS(last ? t0 : t0 + tt + 1, next);
            for (int h = 0; h < nh; h++) {
#define SCORE(R) score_tile(row, h * HD, qa[h * group + r0], R, sc[h * group + r0] + tt * KT, CHUNK_TILES * KT, \
                            r0 == 0 ? next : NULL, (last ? v_offset : 0) + h * HD, v_offset + h * HD)
                BY_SLICE(group, SCORE)
#undef SCORE
            }
        }
        for (int tt = 0; tt < nt; tt++)
            softmax_tile(sc[0] + tt * KT, CHUNK_TILES * KT, nr, TILE_N(t0 + tt), mx, lv, alpha[tt]);
        /* rows[nt & 1] holds the chunk's first tile's rows now; the next chunk's first tile's go
         * to rows[2 nt & 1], rows[0], where its scoring looks */
        for (int tt = 0; tt < nt; tt++) {
            const float **row = rows[(nt + tt) & 1], **next = rows[(nt + tt + 1) & 1];
            const int more = tt + 1 < nt || t0 + nt < tiles;
            if (more) ROWS(t0 + tt + 1, next);
            for (int h = 0; h < nh; h++) {
#define WEIGH(R) weigh_rows(sc[h * group + r0] + tt * KT, CHUNK_TILES * KT, R, row, v_offset + h * HD, \
                            TILE_N(t0 + tt), acc[h * group + r0], alpha[tt] + h * group + r0, \
                            more && r0 == 0 ? next : NULL, (tt + 1 < nt ? v_offset : 0) + h * HD)
                BY_SLICE(group, WEIGH)
#undef WEIGH
            }
        }
    }
#undef ROWS
#undef TILE_N
    for (int r = 0; r < nr; r++) store_out(acc[r], lv[r], o + r * HD);
}
#endif

#define ATTEND(GROUP, HEAD_DIM, BLOCK)                                                                       \
    attend_one(base, block_stride, layer_offset, v_offset, token_stride, qs, o, table, ctx, h, GROUP, HEAD_DIM, \
               BLOCK, scale)

void paged_decode_f32(const float *base, int64_t block_stride, int64_t layer_offset, int64_t v_offset,
                      int64_t token_stride, const float *q, int64_t q_stride, float *out,
                      const int64_t *rows, const int64_t *ctx_lens, const int64_t *tables,
                      const int64_t *table_starts, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                      int64_t head_dim, int64_t block_size, float scale) {
    const int64_t heads = num_kv_heads * group;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (head_dim == HD && group <= MAX_ROWS) {
        /* KV heads per item: all of a sequence's where the sequences alone keep the threads busy
         * (its blocks' rows are then read whole; fewer, unequal sequences left a thread idle),
         * else one */
        const int64_t per = num_kv_heads * group <= MAX_ROWS && num_seqs >= 8 * omp_get_max_threads() ? num_kv_heads : 1;
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads / per; item++) {
            const int64_t s = item * per / num_kv_heads, h = item * per % num_kv_heads;
            attend_tiles(base + layer_offset + h * HD, v_offset, block_stride, token_stride, block_size,
                         tables + table_starts[s], ctx_lens[s], q + rows[s] * q_stride + h * group * HD,
                         out + rows[s] * heads * HD + h * group * HD, scale, (int)group, (int)per);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t ctx = ctx_lens[s];
        const int64_t *table = tables + table_starts[s];
        const float *qs = q + rows[s] * q_stride + h * group * head_dim;
        float *o = out + rows[s] * heads * head_dim + h * group * head_dim;
        /* head_dim 64 reaches here only in the portable build (or with groups over MAX_ROWS) */
        if (group == 3 && head_dim == 64 && block_size == 16)  /* SmolLM2-135M, the default block */
            ATTEND(3, 64, 16);
        else if (head_dim == 64)
            ATTEND(group, 64, block_size);
        else if (head_dim == 128)
            ATTEND(group, 128, block_size);
        else
            ATTEND(group, head_dim, block_size);
    }
}
