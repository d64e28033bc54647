/* Prefill (and chunked-prefill) attention on CPU, reading K/V where they lie in the paged cache.
 *
 * One sequence per call: its last `num_query` positions attend causally over its `ctx` keys
 * (the chunk's own K/V already written). Flash-attention order: for each (query head, tile of
 * 8 query rows, 6 with AVX2) the keys are walked in tiles of 32, the scores folded into a
 * running softmax (max, sum, weighted V), so no score matrix is ever stored beyond one tile.
 *
 * Register blocking, AVX-512 (32 zmm registers):
 *   scores  S[8][32] = Q[8][64] . K^T[64][32]: 16 accumulators (8 rows x 2 zmm), per head dim
 *           two loads of K^T and 8 broadcasts of Q;
 *   values  O[4][64] += P[4][32] . V[32][64]: 16 accumulators (4 rows x 4 zmm), twice per tile,
 *           each V row loaded once for its 4 rows (simd.h's load_row64).
 * AVX2 with FMA (16 ymm registers; query tiles of 6 rows):
 *   scores  S[6][16] = Q[6][64] . K^T[64][16], twice per key tile: 12 accumulators (6 rows x
 *           2 ymm), per head dim two loads of K^T and 6 broadcasts of Q (BLIS's 6x16 block);
 *   values  O[6][16] += P[6][32] . V[32][16], for each quarter of the head dim: 12 accumulators.
 * A row's arithmetic is the same whichever rows share its tile and however the sequence was
 * chunked (key tiles start at key 0; fully masked keys add exact zeros), so chunked prefill
 * gives the bits an unchunked one does.
 * K^T and V are packed once per call, per KV head and key tile ([kvh][tile][64][32] and
 * [kvh][tile][32][64], zeros past ctx: 2 x ctx x kvh x 64 floats, small next to the
 * arithmetic): each is read by every query tile of the group's heads, and a contiguous copy
 * streams where the paged blocks' rows (256 of every 768 bytes, block by block) do not.
 * Tiles below the diagonal skip the masks; the 8 rows' rescale factors are one exp.
 * exp is simd.h's polynomial (|rel err| < 2 ulp over the softmax range);
 * masked keys (past a row's position) get probability exactly 0 through the lane mask.
 *
 * Layout as paged_decode.c (engine/kv_cache.py): element (block b, token t, kv head h, dim d) of
 * layer L's K is at base + b*block_stride + L*layer_stride + t*token_stride + h*head_dim + d, V
 * `v_offset` further. q: [tokens, heads, head_dim] with row stride q_stride; out: row stride
 * out_stride, head h at h*head_dim. head_dim must be 64 (returns 0 without writing otherwise,
 * or where the compiler has neither AVX-512 nor AVX2 with FMA: the caller then uses SDPA);
 * returns 1 when done.
 * Threads: torch's OpenMP runtime, work items (query tile, the query heads of one KV head)
 * scheduled dynamically (causal tiles differ in length), one KV head's items after the other's
 * (so the threads' K/V working set is one head's, 1 MiB at 2,048 keys, not all heads');
 * both kernels walk the key tiles once for all the item's heads (`attend_group`).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HD 64
#define KT 32   /* keys per tile */
#define MAX_GROUP 4  /* query heads of one KV head an item takes at most */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "simd.h"

/* One KV head's key tile, packed: kt[d][j] = K[tile*32 + j][d] and vt[j][d] = V[tile*32 + j][d],
 * zeros past ctx. Both are read once per query tile and head of the group, so a copy in a
 * contiguous stream is cheaper than walking the paged blocks' strided rows each time. */
static void pack_tile(const float *kbase, const float *vbase, const int64_t *table, int64_t block_stride,
                      int64_t token_stride, int64_t block_size, int64_t ctx, int64_t tile, float *kt, float *vt) {
    for (int64_t j = 0; j < KT; j++) {
        const int64_t key = tile * KT + j;
        if (key >= ctx) {
            for (int d = 0; d < HD; d++) kt[d * KT + j] = vt[j * HD + d] = 0.f;
            continue;
        }
        const int64_t off = table[key / block_size] * block_stride + (key % block_size) * token_stride;
        for (int d = 0; d < HD; d++) kt[d * KT + j] = kbase[off + d];
        memcpy(vt + j * HD, vbase + off, HD * sizeof(float));
    }
}

/* A query tile's qt rows q0.. of head hq, scaled (a short tile of m < qt rows repeats its last
 * row, never stored), and their positions; each row's running max starts below any score.
 * Returns the tile's last position. */
static inline __attribute__((always_inline)) int64_t load_queries(const float *q, int64_t q_stride, int64_t q0,
                                                                  int m, int qt, int64_t hq, float scale,
                                                                  int64_t first_pos, float (*qa)[HD], int64_t *pos,
                                                                  float *mx) {
    for (int i = 0; i < qt; i++) {
        const int r = i < m ? i : m - 1;
        const float *src = q + (q0 + r) * q_stride + hq * HD;
        for (int d = 0; d < HD; d++) qa[i][d] = src[d] * scale;
        pos[i] = first_pos + q0 + r;
        mx[i] = -3.0e38f;
    }
    return pos[qt - 1];
}

#ifdef __AVX512F__
#define QT 8    /* query rows per tile */
#define LANES 16
#else
#define QT 6
#define LANES 8
#endif

/* One query head's running state over a query tile's key tiles. */
struct head_state {
    float qa[QT][HD];     /* the tile's queries, scaled */
    float o[QT][HD];      /* weighted V, not yet divided by the sums */
    float p[QT][KT];      /* the key tile's scores, then its probabilities */
    float lv[QT][LANES];  /* per-row sums, one vector's lanes, summed at the end */
    float mx[LANES], nmx[LANES], alpha[LANES];
} __attribute__((aligned(64)));

#ifdef __AVX512F__

/* P[rows][32] . V[32 keys][64] (a packed tile, nk keys of it) added into o[rows][64] (rows <= 4),
 * o scaled by alpha[] first. */
static inline __attribute__((always_inline)) void pv4(const float *p, const float *vt, int nk, float *o,
                                                      const float *alpha) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * HD + c * 16), a);
    }
    for (int j = 0; j < nk; j++) {
        __m512 v0, v1, v2, v3;
        load_row64(vt + j * HD, &v0, &v1, &v2, &v3);
        for (int i = 0; i < 4; i++) {
            const __m512 w = _mm512_set1_ps(p[i * KT + j]);
            acc[i][0] = _mm512_fmadd_ps(w, v0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w, v1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(w, v2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(w, v3, acc[i][3]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + i * HD + c * 16, acc[i][c]);
}

/* One key tile (kt / vt packed, keys k0 = tile * KT on) folded into head st's rows. */
static inline __attribute__((always_inline)) void fold_tile(struct head_state *st, const float *kt,
                                                            const float *vt, int64_t tile, const int64_t *pos,
                                                            int64_t last) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lo = _mm512_set1_ps(-3.0e38f);
    __m512 s0[QT], s1[QT];
    for (int i = 0; i < QT; i++) s0[i] = s1[i] = _mm512_setzero_ps();
    for (int d = 0; d < HD; d++) {
        const __m512 b0 = _mm512_load_ps(kt + d * KT), b1 = _mm512_load_ps(kt + d * KT + 16);
        for (int i = 0; i < QT; i++) {
            const __m512 a = _mm512_set1_ps(st->qa[i][d]);
            s0[i] = _mm512_fmadd_ps(a, b0, s0[i]);
            s1[i] = _mm512_fmadd_ps(a, b1, s1[i]);
        }
    }
    const int64_t k0 = tile * KT;
    /* Keys past a row's position are masked; a tile every row sees whole (all but the
     * diagonal ones; pos[0] is the smallest) skips the masks. */
    __mmask16 m0[QT], m1[QT];
    if (k0 + KT - 1 <= pos[0]) {
        for (int i = 0; i < QT; i++) m0[i] = m1[i] = 0xffff;
    } else {
        const __m512 key0 = _mm512_add_ps(iota, _mm512_set1_ps((float)k0));
        const __m512 key1 = _mm512_add_ps(key0, _mm512_set1_ps(16.f));
        for (int i = 0; i < QT; i++) {
            const __m512 lim = _mm512_set1_ps((float)pos[i]);
            m0[i] = _mm512_cmp_ps_mask(key0, lim, _CMP_LE_OQ);
            m1[i] = _mm512_cmp_ps_mask(key1, lim, _CMP_LE_OQ);
            s0[i] = _mm512_mask_mov_ps(lo, m0[i], s0[i]);
            s1[i] = _mm512_mask_mov_ps(lo, m1[i], s1[i]);
        }
    }
    for (int i = 0; i < QT; i++) {
        const float tmax = _mm512_reduce_max_ps(_mm512_max_ps(s0[i], s1[i]));
        st->nmx[i] = tmax > st->mx[i] ? tmax : st->mx[i];
    }
    /* the 8 rows' rescale factors exp(old max - new max) in one exp */
    _mm512_store_ps(st->alpha, exp512(_mm512_sub_ps(_mm512_load_ps(st->mx), _mm512_load_ps(st->nmx))));
    for (int i = 0; i < QT; i++) {
        st->mx[i] = st->nmx[i];
        const __m512 nmv = _mm512_set1_ps(st->nmx[i]);
        const __m512 e0 = _mm512_maskz_mov_ps(m0[i], exp512(_mm512_sub_ps(s0[i], nmv)));
        const __m512 e1 = _mm512_maskz_mov_ps(m1[i], exp512(_mm512_sub_ps(s1[i], nmv)));
        _mm512_store_ps(st->lv[i], _mm512_fmadd_ps(_mm512_load_ps(st->lv[i]), _mm512_set1_ps(st->alpha[i]),
                                                   _mm512_add_ps(e0, e1)));
        _mm512_store_ps(st->p[i], e0);
        _mm512_store_ps(st->p[i] + 16, e1);
    }
    const int nk = (int)((last + 1 - k0) < KT ? (last + 1 - k0) : KT);
    pv4(st->p[0], vt, nk, st->o[0], st->alpha);
    pv4(st->p[4], vt, nk, st->o[4], st->alpha + 4);
}

/* Row i of head st, divided by its sum, into dst (64 floats). */
static inline void store_row(const struct head_state *st, int i, float *dst) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(st->lv[i])));
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(st->o[i] + c * 16), inv));
}

#else  /* AVX2 with FMA */

/* AVX2: P[6][32] . V[32 keys][16] (a quarter c of the head dim; nk keys of the tile) added into
 * o[6][64]'s quarter, o scaled by alpha[] first. */
static inline __attribute__((always_inline)) void pv6(const float *p, const float *vt, int nk, float *o,
                                                      const float *alpha, int c) {
    __m256 acc[QT][2];
    for (int i = 0; i < QT; i++) {
        const __m256 a = _mm256_set1_ps(alpha[i]);
        acc[i][0] = _mm256_mul_ps(_mm256_load_ps(o + i * HD + c * 16), a);
        acc[i][1] = _mm256_mul_ps(_mm256_load_ps(o + i * HD + c * 16 + 8), a);
    }
    for (int j = 0; j < nk; j++) {
        const __m256 v0 = _mm256_load_ps(vt + j * HD + c * 16), v1 = _mm256_load_ps(vt + j * HD + c * 16 + 8);
        for (int i = 0; i < QT; i++) {
            const __m256 w = _mm256_broadcast_ss(p + i * KT + j);
            acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < QT; i++) {
        _mm256_store_ps(o + i * HD + c * 16, acc[i][0]);
        _mm256_store_ps(o + i * HD + c * 16 + 8, acc[i][1]);
    }
}

/* One key tile (kt / vt packed, keys k0 = tile * KT on) folded into head st's rows. */
static inline __attribute__((always_inline)) void fold_tile(struct head_state *st, const float *kt,
                                                            const float *vt, int64_t tile, const int64_t *pos,
                                                            int64_t last) {
    float (*sc)[KT] = st->p;  /* the tile's scores, then its probabilities */
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lo = _mm256_set1_ps(-3.0e38f);
    for (int h = 0; h < KT; h += 16) {
        __m256 s0[QT], s1[QT];
        for (int i = 0; i < QT; i++) s0[i] = s1[i] = _mm256_setzero_ps();
        for (int d = 0; d < HD; d++) {
            const __m256 b0 = _mm256_load_ps(kt + d * KT + h), b1 = _mm256_load_ps(kt + d * KT + h + 8);
            for (int i = 0; i < QT; i++) {
                const __m256 a = _mm256_broadcast_ss(&st->qa[i][d]);
                s0[i] = _mm256_fmadd_ps(a, b0, s0[i]);
                s1[i] = _mm256_fmadd_ps(a, b1, s1[i]);
            }
        }
        for (int i = 0; i < QT; i++) {
            _mm256_store_ps(sc[i] + h, s0[i]);
            _mm256_store_ps(sc[i] + h + 8, s1[i]);
        }
    }
    const int64_t k0 = tile * KT;
    /* Keys past a row's position are masked (all ones: every row sees the whole tile) */
    __m256 mk[QT][4];
    const int whole = k0 + KT - 1 <= pos[0];
    for (int i = 0; i < QT; i++) {
        __m256 s[4];
        const __m256 lim = _mm256_set1_ps((float)pos[i]);
        for (int c = 0; c < 4; c++) {
            s[c] = _mm256_load_ps(sc[i] + c * 8);
            if (whole) {
                mk[i][c] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            } else {
                const __m256 key = _mm256_add_ps(iota, _mm256_set1_ps((float)(k0 + c * 8)));
                mk[i][c] = _mm256_cmp_ps(key, lim, _CMP_LE_OQ);
                s[c] = _mm256_blendv_ps(lo, s[c], mk[i][c]);
                _mm256_store_ps(sc[i] + c * 8, s[c]);
            }
        }
        const float tmax = hmax256(_mm256_max_ps(_mm256_max_ps(s[0], s[1]), _mm256_max_ps(s[2], s[3])));
        st->nmx[i] = tmax > st->mx[i] ? tmax : st->mx[i];
    }
    /* the 6 rows' rescale factors exp(old max - new max) in one exp */
    _mm256_store_ps(st->alpha, exp256(_mm256_sub_ps(_mm256_load_ps(st->mx), _mm256_load_ps(st->nmx))));
    for (int i = 0; i < QT; i++) {
        st->mx[i] = st->nmx[i];
        const __m256 nmv = _mm256_set1_ps(st->nmx[i]);
        __m256 e[4];
        for (int c = 0; c < 4; c++) {
            e[c] = _mm256_and_ps(mk[i][c], exp256(_mm256_sub_ps(_mm256_load_ps(sc[i] + c * 8), nmv)));
            _mm256_store_ps(sc[i] + c * 8, e[c]);
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3]));
        _mm256_store_ps(st->lv[i], _mm256_fmadd_ps(_mm256_load_ps(st->lv[i]), _mm256_set1_ps(st->alpha[i]), sum));
    }
    const int nk = (int)((last + 1 - k0) < KT ? (last + 1 - k0) : KT);
    for (int c = 0; c < 4; c++) pv6(sc[0], vt, nk, st->o[0], st->alpha, c);
}

/* Row i of head st, divided by its sum, into dst (64 floats). */
static inline void store_row(const struct head_state *st, int i, float *dst) {
    const __m256 inv = _mm256_set1_ps(1.f / hsum256(_mm256_load_ps(st->lv[i])));
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(dst + c * 8, _mm256_mul_ps(_mm256_load_ps(st->o[i] + c * 8), inv));
}

#endif

/* Query heads hq0 .. hq0+ng-1 (ng <= MAX_GROUP, all of one KV head) on one query tile: rows
 * q0 .. q0+m-1 of the chunk, absolute positions first_pos + row. kt_head / vt_head: their KV
 * head, packed (pack_tile). The heads take each key tile in turn, so a tile is read from
 * memory once for all of them and then from L1 (one head after the other over the whole
 * context re-read it from L3: the packed K/V of a long context outgrow L2). Each head's
 * arithmetic is the same as alone. */
static void attend_group(const float *q, int64_t q_stride, float *out, int64_t out_stride, const float *kt_head,
                         const float *vt_head, int64_t first_pos, int64_t q0, int m, int64_t hq0, int ng,
                         float scale) {
    struct head_state st[MAX_GROUP];
    int64_t pos[QT] = {0}, last = 0;  /* ng >= 1 sets both */
    for (int g = 0; g < ng; g++) {
        memset(&st[g], 0, sizeof st[g]);
        last = load_queries(q, q_stride, q0, m, QT, hq0 + g, scale, first_pos, st[g].qa, pos, st[g].mx);
    }
    for (int64_t tile = 0; tile * KT <= last; tile++)
        for (int g = 0; g < ng; g++)
            fold_tile(&st[g], kt_head + tile * (HD * KT), vt_head + tile * (KT * HD), tile, pos, last);
    for (int g = 0; g < ng; g++)
        for (int i = 0; i < m; i++) store_row(&st[g], i, out + (q0 + i) * out_stride + (hq0 + g) * HD);
}

int paged_prefill_f32(const float *base, int64_t block_stride, int64_t layer_offset, int64_t v_offset,
                      int64_t token_stride, const float *q, int64_t q_stride, float *out, int64_t out_stride,
                      const int64_t *table, int64_t ctx, int64_t num_query, int64_t kvh, int64_t group,
                      int64_t head_dim, int64_t block_size, float scale) {
    if (head_dim != HD || num_query < 1 || num_query > ctx) return 0;
    const int64_t tiles = (ctx + KT - 1) / KT;
    const size_t packed = (size_t)(kvh * tiles * HD * KT);
    float *kt = aligned_alloc(64, 2 * packed * sizeof(float)), *vt = kt + packed;
    if (!kt) return 0;
    const float *kbase = base + layer_offset;
    const int64_t qtiles = (num_query + QT - 1) / QT, first_pos = ctx - num_query;
    /* a work item: one query tile of `per` query heads of one KV head (all of the group where
     * that leaves items enough to keep every thread busy, else one head each) */
    const int64_t per = kvh * qtiles >= 4 * omp_get_max_threads() ? (group < MAX_GROUP ? group : MAX_GROUP) : 1;
    const int64_t slices = (group + per - 1) / per, items = qtiles * kvh * slices;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < kvh * tiles; w++)
            pack_tile(kbase + (w / tiles) * HD, kbase + v_offset + (w / tiles) * HD, table, block_stride,
                      token_stride, block_size, ctx, w % tiles, kt + w * (HD * KT), vt + w * (HD * KT));
        /* One KV head after the other (the threads share its packed K/V, which fits a core's L2
         * where all heads' may not), its longest query tiles (the last) first: dynamic
         * scheduling then balances the rest. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            const int64_t h = w / (qtiles * slices), r = w % (qtiles * slices);  /* KV head */
            const int64_t t = qtiles - 1 - r / slices, first = r % slices * per;  /* its first query head here */
            const int64_t q0 = t * QT;
            const int m = (int)(num_query - q0 < QT ? num_query - q0 : QT);
            attend_group(q, q_stride, out, out_stride, kt + h * tiles * (HD * KT), vt + h * tiles * (HD * KT),
                         first_pos, q0, m, h * group + first, (int)(group - first < per ? group - first : per), scale);
        }
    }
    free(kt);
    return 1;
}

int paged_prefill_built(void) { return 1; }

#else  /* neither AVX-512 nor AVX2 with FMA: the caller falls back to SDPA */

int paged_prefill_built(void) { return 0; }

int paged_prefill_f32(const float *base, int64_t block_stride, int64_t layer_offset, int64_t v_offset,
                      int64_t token_stride, const float *q, int64_t q_stride, float *out, int64_t out_stride,
                      const int64_t *table, int64_t ctx, int64_t num_query, int64_t kvh, int64_t group,
                      int64_t head_dim, int64_t block_size, float scale) {
    (void)base; (void)block_stride; (void)layer_offset; (void)v_offset; (void)token_stride; (void)q;
    (void)q_stride; (void)out; (void)out_stride; (void)table; (void)ctx; (void)num_query; (void)kvh;
    (void)group; (void)head_dim; (void)block_size; (void)scale;
    return 0;
}

#endif
