/* Paged decode attention on CPU, reading K/V where they lie in the paged cache.
 *
 * One query token per sequence (a decode step). For each (sequence, KV head) the kernel walks
 * the sequence's block table, scores the head's `group` query heads against the keys, and folds
 * them into a running softmax (max, sum, weighted V) as flash-decoding does (per block in
 * `attend_one`, per chunk of blocks in `attend_g3`): K/V are read once, in place, never copied
 * into a workspace.
 *
 * Layout (engine/kv_cache.py): element (block b, token t, kv head h, dim d) of layer L's K is at
 *   base + b * block_stride + L * layer_stride + t * token_stride + h * head_dim + d,
 * and V is `v_offset` elements further. All strides are in elements (float32).
 * q: [tokens, heads, head_dim] with row stride q_stride; out: [tokens, heads, head_dim] contiguous.
 * Work items (sequence, KV head), or whole sequences (given many: `attend_seq` with AVX-512,
 * the AVX2 `attend_g3`), are spread over the OpenMP threads (torch's own runtime: the library
 * is loaded into a process that already holds torch's libgomp).
 *
 * Two implementations of one item: `attend_g3` in intrinsics (AVX-512, or AVX2 with FMA) for
 * groups of 3 query heads, head_dim 64 and 16-token blocks (SmolLM2-135M's shapes with the
 * default block), and the portable `attend_one` (auto-vectorised C) for everything else.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64
#define MAX_KV_HEADS 4  /* KV heads a whole-sequence work item takes at most */

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

#define CHUNK_BLOCKS 64  /* blocks scored before their softmax and V pass: 1,024 keys, 12 KB of scores */
#endif

#ifdef __AVX512F__
/* Prefetch one block's 16 rows of one head (K or V) into L2: each block lies elsewhere in
 * memory, which the hardware prefetcher cannot guess. */
static inline __attribute__((always_inline)) void prefetch_rows(const float *rows, int64_t token_stride) {
    for (int t = 0; t < 16; t++)
        for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(rows + t * token_stride + c * 16), _MM_HINT_T1);
}

/* The 16 lane sums of v[0..15] (a vector each), in a fixed lane order (`sum_order` undoes it):
 * three rounds of shuffle-and-add halve the vectors, 45 operations for 16 sums where 16
 * horizontal sums take ~130. */
static inline __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]), _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x44), _mm512_shuffle_ps(z[0], z[1], 0xEE));
}

/* idx with permutexvar(idx, sum16(v))[t] = the sum of v[t]: found by summing v[t] = t. */
static __m512i sum_order(void) {
    __m512 v[16];
    for (int t = 0; t < 16; t++) v[t] = _mm512_set1_ps((float)t);
    float w[16];
    _mm512_storeu_ps(w, sum16(v));
    int idx[16];
    for (int lane = 0; lane < 16; lane++) idx[(int)(w[lane] / 16.f + 0.5f)] = lane;
    return _mm512_loadu_si512(idx);
}

/* One block's n (1..16) keys of one KV head scored against 3 query heads into sc[g][0..16):
 * slots t >= n get 0 and lie past the sequence's end, which the softmax masks. Each key's 3
 * partial products (one vector per query head) go to a small buffer and `sum16` turns a head's
 * 16 of them into its 16 scores at once; each K row is loaded once for the 3 heads. */
static inline __attribute__((always_inline)) void score_block(const __m512 q[3][4], const float *kb,
                                                              int64_t token_stride, int n, float *sc0, float *sc1,
                                                              float *sc2, __m512i order) {
    float part[3][16][16] __attribute__((aligned(64)));
    for (int t = 0; t < 16; t++) {
        if (t >= n) {  /* slots past ctx are never read (they may hold garbage) */
            for (int g = 0; g < 3; g++) _mm512_store_ps(part[g][t], _mm512_setzero_ps());
            continue;
        }
        __m512 k0, k1, k2, k3;
        load_row64(kb + t * token_stride, &k0, &k1, &k2, &k3);
        for (int g = 0; g < 3; g++) {
            __m512 s = _mm512_mul_ps(q[g][0], k0);
            s = _mm512_fmadd_ps(q[g][1], k1, s);
            s = _mm512_fmadd_ps(q[g][2], k2, s);
            s = _mm512_fmadd_ps(q[g][3], k3, s);
            _mm512_store_ps(part[g][t], s);
        }
    }
    float *dst[3] = {sc0, sc1, sc2};
    for (int g = 0; g < 3; g++) {
        __m512 v[16];
        for (int t = 0; t < 16; t++) v[t] = _mm512_load_ps(part[g][t]);
        _mm512_store_ps(dst[g], _mm512_permutexvar_ps(order, sum16(v)));
    }
}

/* sc[0..nt) (64-byte aligned, room for whole vectors) becomes exp(sc - m'), m' the larger of
 * *mx and the chunk's max; *mx = m', *l = *l * exp(old mx - m') + the chunk's sum, and the
 * factor exp(old mx - m') (0 on the first chunk, where *mx is -3e38) is returned for the
 * weighted V sums. */
static inline __attribute__((always_inline)) float softmax_chunk(float *sc, int64_t nt, float *mx, float *l) {
    const int64_t nfull = nt / 16;
    const __mmask16 tail = (__mmask16)((1u << (nt % 16)) - 1);
    __m512 m = _mm512_set1_ps(-3.0e38f);
    for (int64_t i = 0; i < nfull; i++) m = _mm512_max_ps(m, _mm512_load_ps(sc + i * 16));
    if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_load_ps(sc + nfull * 16));
    const float bm = _mm512_reduce_max_ps(m), nm = bm > *mx ? bm : *mx;
    const float c = expf(*mx - nm);
    *mx = nm;
    const __m512 vm = _mm512_set1_ps(nm);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < nfull; i++) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(sc + i * 16), vm));
        _mm512_store_ps(sc + i * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_load_ps(sc + nfull * 16), vm)));
        _mm512_store_ps(sc + nfull * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    *l = *l * c + _mm512_reduce_add_ps(sum);
    return c;
}

/* Blocks scored together by the whole-sequence kernel: IL blocks' K rows read interleaved (row t
 * of each, then row t + 1), IL sequential streams at once, which the L2 streamer keeps ahead of
 * where one block after another, each a new 12 KB run, leaves it behind. A key's score does not
 * depend on the order the keys are scored in; V is added block by block, in key order. */
#define IL 4

/* One (sequence, KV head) for 3 query heads, head_dim 64, 16-token blocks. Two passes over each
 * chunk of CHUNK_BLOCKS blocks: every key's score first (K pass), then one softmax over the
 * chunk, then the weighted V sum (V pass); chunks fold into a running max and sum as
 * flash-decoding's blocks do. Scoring a whole chunk before its softmax takes the per-block
 * max / exp / rescale chain off the loop that streams K, so blocks overlap in the core and the
 * loads keep the memory busy (the one-pass loop folded each block into the softmax before the
 * next). The queries and the weighted V (3 x 64 each) stay in registers; the next block's rows
 * are prefetched. */
static void attend_g3(const float *kbase, int64_t v_offset, int64_t block_stride, int64_t token_stride,
                      const int64_t *table, int64_t ctx, const float *qs, float *o, float scale, __m512i order) {
    __m512 q[3][4], acc[3][4];
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++) {
            q[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qs + g * 64 + c * 16), _mm512_set1_ps(scale));
            acc[g][c] = _mm512_setzero_ps();
        }
    float mx[3] = {-3.0e38f, -3.0e38f, -3.0e38f}, l[3] = {0.f, 0.f, 0.f};
    float sc[3][CHUNK_BLOCKS * 16] __attribute__((aligned(64)));
    const int64_t nblocks = (ctx + 15) / 16;
    for (int64_t j0 = 0; j0 < nblocks; j0 += CHUNK_BLOCKS) {
        const int64_t nb = nblocks - j0 < CHUNK_BLOCKS ? nblocks - j0 : CHUNK_BLOCKS;
        const int64_t nt = (j0 + nb) * 16 < ctx ? nb * 16 : ctx - j0 * 16;  /* keys in the chunk */
        for (int64_t jj = 0; jj < nb; jj++) {
            const int64_t j = j0 + jj;
            if (j + 1 < nblocks) prefetch_rows(kbase + table[j + 1] * block_stride, token_stride);
            const int n = ctx - j * 16 < 16 ? (int)(ctx - j * 16) : 16;
            score_block(q, kbase + table[j] * block_stride, token_stride, n, sc[0] + jj * 16, sc[1] + jj * 16,
                        sc[2] + jj * 16, order);
        }
        for (int g = 0; g < 3; g++) {
            const __m512 c = _mm512_set1_ps(softmax_chunk(sc[g], nt, &mx[g], &l[g]));
            for (int cc = 0; cc < 4; cc++) acc[g][cc] = _mm512_mul_ps(acc[g][cc], c);
        }
        for (int64_t jj = 0; jj < nb; jj++) {
            const int64_t j = j0 + jj;
            const float *vb = kbase + table[j] * block_stride + v_offset;
            if (jj + 1 < nb) prefetch_rows(kbase + table[j + 1] * block_stride + v_offset, token_stride);
            const int n = ctx - j * 16 < 16 ? (int)(ctx - j * 16) : 16;
            for (int t = 0; t < n; t++) {
                __m512 v0, v1, v2, v3;
                load_row64(vb + t * token_stride, &v0, &v1, &v2, &v3);
                for (int g = 0; g < 3; g++) {
                    const __m512 w = _mm512_set1_ps(sc[g][jj * 16 + t]);
                    acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
                    acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
                    acc[g][2] = _mm512_fmadd_ps(w, v2, acc[g][2]);
                    acc[g][3] = _mm512_fmadd_ps(w, v3, acc[g][3]);
                }
            }
        }
    }
    for (int g = 0; g < 3; g++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + g * 64 + c * 16, _mm512_mul_ps(acc[g][c], inv));
    }
}

/* One whole sequence: its nh (1..MAX_KV_HEADS) KV heads, 3 query heads each, for batches with
 * enough sequences to keep the threads busy. A block's token rows hold every KV head side by
 * side (768 bytes for 3), read whole (K: IL blocks at a time, row by row); a KV head per item
 * reads 256 of every 768 bytes, one block after another (docs/BENCHMARKS.md, "Decode attention:
 * a whole sequence per work item"). The arithmetic is attend_g3's for each head (its products,
 * sums, chunks and V order), so a sequence gets the same bits from either kernel, whatever its
 * batch. The queries live in L1 (9 x 64 do not fit the registers beside the rest); V is summed
 * for two KV heads at a time (24 accumulators in registers). */
static void attend_seq(const float *kbase, int64_t v_offset, int64_t block_stride, int64_t token_stride,
                       const int64_t *table, int64_t ctx, const float *qs, float *o, float scale, int nh,
                       __m512i order) {
    float q[MAX_KV_HEADS * 3][64] __attribute__((aligned(64))), acc[MAX_KV_HEADS * 3][64] __attribute__((aligned(64)));
    float mx[MAX_KV_HEADS * 3], l[MAX_KV_HEADS * 3];
    float sc[MAX_KV_HEADS * 3][CHUNK_BLOCKS * 16] __attribute__((aligned(64)));
    float part[IL][MAX_KV_HEADS * 3][16][16] __attribute__((aligned(64)));  /* as score_block's, per block */
    const int nq = nh * 3;
    for (int g = 0; g < nq; g++) {
        for (int d = 0; d < 64; d++) {
            q[g][d] = qs[g * 64 + d] * scale;
            acc[g][d] = 0.f;
        }
        mx[g] = -3.0e38f;
        l[g] = 0.f;
    }
    const int64_t nblocks = (ctx + 15) / 16;
    for (int64_t j0 = 0; j0 < nblocks; j0 += CHUNK_BLOCKS) {
        const int64_t nb = nblocks - j0 < CHUNK_BLOCKS ? nblocks - j0 : CHUNK_BLOCKS;
        const int64_t nt = (j0 + nb) * 16 < ctx ? nb * 16 : ctx - j0 * 16;  /* keys in the chunk */
        for (int64_t jj0 = 0; jj0 < nb; jj0 += IL) {
            const int ng = nb - jj0 < IL ? (int)(nb - jj0) : IL;  /* the group's blocks */
            const float *kb[IL];
            int n[IL];
            for (int b = 0; b < ng; b++) {
                const int64_t j = j0 + jj0 + b;
                kb[b] = kbase + table[j] * block_stride;
                n[b] = ctx - j * 16 < 16 ? (int)(ctx - j * 16) : 16;
            }
            for (int t = 0; t < 16; t++)
                for (int b = 0; b < ng; b++) {
                    if (t >= n[b]) {  /* slots past ctx are never read (they may hold garbage) */
                        for (int g = 0; g < nq; g++) _mm512_store_ps(part[b][g][t], _mm512_setzero_ps());
                        continue;
                    }
                    for (int h = 0; h < nh; h++) {
                        __m512 k0, k1, k2, k3;
                        load_row64(kb[b] + t * token_stride + h * 64, &k0, &k1, &k2, &k3);
                        for (int gg = 0; gg < 3; gg++) {  /* score_block's products, in its order */
                            const float *qq = q[h * 3 + gg];
                            __m512 s = _mm512_mul_ps(_mm512_load_ps(qq), k0);
                            s = _mm512_fmadd_ps(_mm512_load_ps(qq + 16), k1, s);
                            s = _mm512_fmadd_ps(_mm512_load_ps(qq + 32), k2, s);
                            s = _mm512_fmadd_ps(_mm512_load_ps(qq + 48), k3, s);
                            _mm512_store_ps(part[b][h * 3 + gg][t], s);
                        }
                    }
                }
            for (int b = 0; b < ng; b++)
                for (int g = 0; g < nq; g++) {
                    __m512 v[16];
                    for (int t = 0; t < 16; t++) v[t] = _mm512_load_ps(part[b][g][t]);
                    _mm512_store_ps(sc[g] + (jj0 + b) * 16, _mm512_permutexvar_ps(order, sum16(v)));
                }
        }
        for (int g = 0; g < nq; g++) {
            const __m512 c = _mm512_set1_ps(softmax_chunk(sc[g], nt, &mx[g], &l[g]));
            for (int cc = 0; cc < 4; cc++)
                _mm512_store_ps(acc[g] + cc * 16, _mm512_mul_ps(_mm512_load_ps(acc[g] + cc * 16), c));
        }
        for (int64_t jj = 0; jj < nb; jj++) {  /* keys in order, as attend_g3 adds them */
            const int64_t j = j0 + jj;
            const float *vb = kbase + table[j] * block_stride + v_offset;
            const int n = ctx - j * 16 < 16 ? (int)(ctx - j * 16) : 16;
            /* The next block's V (elsewhere in memory: the L2 streamer starts on it only after
             * a few misses), prefetched whole, a row for each row read in the first pair's walk */
            const char *next = jj + 1 < nb ? (const char *)(kbase + table[j + 1] * block_stride + v_offset) : 0;
            const int64_t row_bytes = token_stride * (int64_t)sizeof(float);
            for (int h0 = 0; h0 < nh; h0 += 2) {
                const int heads = h0 + 1 < nh ? 2 : 1;
                __m512 a[6][4];
                for (int g = 0; g < 3 * heads; g++)
                    for (int c = 0; c < 4; c++) a[g][c] = _mm512_load_ps(acc[h0 * 3 + g] + c * 16);
                for (int t = 0; t < n; t++) {
                    if (h0 == 0 && next)
                        for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(next + t * row_bytes + c, _MM_HINT_T0);
                    for (int hh = 0; hh < heads; hh++) {
                        __m512 v0, v1, v2, v3;
                        load_row64(vb + t * token_stride + (h0 + hh) * 64, &v0, &v1, &v2, &v3);
                        for (int g = hh * 3; g < hh * 3 + 3; g++) {
                            const __m512 w = _mm512_set1_ps(sc[h0 * 3 + g][jj * 16 + t]);
                            a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
                            a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
                            a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
                            a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
                        }
                    }
                }
                for (int g = 0; g < 3 * heads; g++)
                    for (int c = 0; c < 4; c++) _mm512_store_ps(acc[h0 * 3 + g] + c * 16, a[g][c]);
            }
        }
    }
    for (int g = 0; g < nq; g++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(o + g * 64 + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[g] + c * 16), inv));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same item with AVX2 (16 registers of 8 floats): the same two passes a chunk; what changes
 * is what fits the registers. Scores: 4 keys at a time, each query vector (from L1) loaded once
 * for the 4 keys' 12 running products (3 heads x 4 keys), and `sum8` turns 8 keys' partial
 * vectors into their 8 scores. The weighted V sum (3 x 64, 24 vectors) does not fit: a block's
 * V rows are walked once per half of the head dim (the block is in L1 by the second walk), that
 * half's 12 sums in registers. Prefetch: while a block is read, the next block is prefetched a
 * few lines per row read (K in the score pass, V in the V pass; the last block of a pass fetches
 * the first of the next), spread through the loop: on Zen 3 a burst of a block's prefetches (the
 * AVX-512 kernel's way) was slower than none, spread ones faster than both (docs/BENCHMARKS.md,
 * "Decode attention on AVX2"). */

/* r[t] = the sum of v[t]'s 8 lanes, t = 0..7: a tree of hadds, the same order for every t. */
static inline __m256 sum8(const __m256 *v) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Lanes below n set (all bits), the rest clear; n in 0..8. */
static inline __m256 lanes_below(int64_t n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* One block's n (1..16) keys of one KV head scored against 3 query heads (q: [3][64], scaled)
 * into sc[g][0..16); slots t >= n get 0 (the softmax masks them). Each group of 4 keys
 * prefetches 4 x 4 lines of the next block: group k's at pf + k * pf_group + r * pf_row
 * (r = 0..3), which the caller points at a quarter of this head's rows or at 16 consecutive lines
 * (attend_g3). */
static inline __attribute__((always_inline)) void score_block8(const float *q, const float *kb, int64_t token_stride,
                                                               int n, float *sc0, float *sc1, float *sc2, const float *pf,
                                                               int64_t pf_group, int64_t pf_row) {
    float *dst[3] = {sc0, sc1, sc2};
    for (int t0 = 0; t0 < 16; t0 += 8) {
        __m256 part[3][8];
        for (int t4 = 0; t4 < 8; t4 += 4) {
            /* Rows past the sequence's end are scored on row 0 (finite) and the scores dropped:
             * the slots past n may hold anything, NaN included. */
            const float *k[4];
            for (int t = 0; t < 4; t++) k[t] = t0 + t4 + t < n ? kb + (t0 + t4 + t) * token_stride : kb;
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    _mm_prefetch((const char *)(pf + (t0 + t4) / 4 * pf_group + r * pf_row + c * 16), _MM_HINT_T0);
            __m256 a[4][3];
            for (int c = 0; c < 8; c++) {
                const __m256 q0 = _mm256_load_ps(q + c * 8), q1 = _mm256_load_ps(q + 64 + c * 8);
                const __m256 q2 = _mm256_load_ps(q + 128 + c * 8);
                for (int t = 0; t < 4; t++) {
                    const __m256 x = _mm256_loadu_ps(k[t] + c * 8);
                    if (c == 0) {
                        a[t][0] = _mm256_mul_ps(q0, x);
                        a[t][1] = _mm256_mul_ps(q1, x);
                        a[t][2] = _mm256_mul_ps(q2, x);
                    } else {
                        a[t][0] = _mm256_fmadd_ps(q0, x, a[t][0]);
                        a[t][1] = _mm256_fmadd_ps(q1, x, a[t][1]);
                        a[t][2] = _mm256_fmadd_ps(q2, x, a[t][2]);
                    }
                }
            }
            for (int t = 0; t < 4; t++)
                for (int g = 0; g < 3; g++) part[g][t4 + t] = t0 + t4 + t < n ? a[t][g] : _mm256_setzero_ps();
        }
        for (int g = 0; g < 3; g++) _mm256_store_ps(dst[g] + t0, sum8(part[g]));
    }
}

/* As the AVX-512 softmax_chunk: sc[0..nt) (32-byte aligned, whole vectors) becomes
 * exp(sc - m'); returns exp(old max - m'), the factor for the weighted V sums. */
static inline __attribute__((always_inline)) float softmax_chunk8(float *sc, int64_t nt, float *mx, float *l) {
    const int64_t nfull = nt / 8, rem = nt % 8;
    const __m256 tail = lanes_below(rem), lowest = _mm256_set1_ps(-3.0e38f);
    __m256 m = lowest;
    for (int64_t i = 0; i < nfull; i++) m = _mm256_max_ps(m, _mm256_load_ps(sc + i * 8));
    if (rem) m = _mm256_max_ps(m, _mm256_blendv_ps(lowest, _mm256_load_ps(sc + nfull * 8), tail));
    const float bm = hmax256(m), nm = bm > *mx ? bm : *mx;
    const float c = expf(*mx - nm);
    *mx = nm;
    const __m256 vm = _mm256_set1_ps(nm);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < nfull; i++) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(sc + i * 8), vm));
        _mm256_store_ps(sc + i * 8, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (rem) {
        const __m256 e = _mm256_and_ps(tail, exp256(_mm256_sub_ps(_mm256_load_ps(sc + nfull * 8), vm)));
        _mm256_store_ps(sc + nfull * 8, e);
        sum = _mm256_add_ps(sum, e);
    }
    *l = *l * c + hsum256(sum);
    return c;
}

/* acc[g][half * 32 ..][0..32) += sum over the block's n keys of p[g][t] * V[t][half * 32 ..].
 * Unless pf is NULL, key t prefetches the 2 lines at pf + t * pf_row of the next block. */
static inline __attribute__((always_inline)) void weigh_half(float *acc, const float *vb, int64_t token_stride,
                                                             int n, const float *p0, const float *p1,
                                                             const float *p2, int half, const float *pf,
                                                             int64_t pf_row) {
    const float *p[3] = {p0, p1, p2};
    __m256 a[3][4];
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++) a[g][c] = _mm256_load_ps(acc + g * 64 + half * 32 + c * 8);
    for (int t = 0; t < n; t++) {
        const float *v = vb + t * token_stride + half * 32;
        if (pf) for (int c = 0; c < 2; c++) _mm_prefetch((const char *)(pf + t * pf_row + c * 16), _MM_HINT_T0);
        const __m256 w0 = _mm256_broadcast_ss(p[0] + t), w1 = _mm256_broadcast_ss(p[1] + t);
        const __m256 w2 = _mm256_broadcast_ss(p[2] + t);
        for (int c = 0; c < 4; c++) {
            const __m256 x = _mm256_loadu_ps(v + c * 8);
            a[0][c] = _mm256_fmadd_ps(w0, x, a[0][c]);
            a[1][c] = _mm256_fmadd_ps(w1, x, a[1][c]);
            a[2][c] = _mm256_fmadd_ps(w2, x, a[2][c]);
        }
    }
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++) _mm256_store_ps(acc + g * 64 + half * 32 + c * 8, a[g][c]);
}

/* nh (1..MAX_KV_HEADS) KV heads of one sequence, each as the AVX-512 attend_g3: KV head h's K
 * at kbase + h * 64, its 3 queries at qs + h * 192, its outputs at o + h * 192. The heads take
 * each block in turn, so a block's token rows (all KV heads side by side) are read whole, while
 * they are in one DRAM page: one head alone reads 256 of every 768 bytes, and a summing loop
 * over the cache that way streamed two thirds as fast as over whole rows (docs/BENCHMARKS.md,
 * "Prefill attention by KV head, decode attention by sequence"). Each head's arithmetic is the
 * same whatever nh. */
static void attend_g3(const float *kbase, int64_t v_offset, int64_t block_stride, int64_t token_stride,
                      const int64_t *table, int64_t ctx, const float *qs, float *o, float scale, int nh) {
    float q[MAX_KV_HEADS][3 * 64] __attribute__((aligned(32))), acc[MAX_KV_HEADS][3 * 64] __attribute__((aligned(32)));
    float mx[MAX_KV_HEADS][3], l[MAX_KV_HEADS][3];
    float sc[MAX_KV_HEADS][3][CHUNK_BLOCKS * 16] __attribute__((aligned(32)));
    for (int h = 0; h < nh; h++) {
        for (int d = 0; d < 3 * 64; d++) {
            q[h][d] = qs[h * 192 + d] * scale;
            acc[h][d] = 0.f;
        }
        for (int g = 0; g < 3; g++) {
            mx[h][g] = -3.0e38f;
            l[h][g] = 0.f;
        }
    }
    /* Prefetch order: with whole rows (the item holds every KV head) each call prefetches its
     * share of the next block in address order (K: 12 groups of 16 lines, V: 6 walks of 32), so
     * the block streams in as one run; with one head, that head's rows. Address order read faster
     * than the same lines in the order they are used (docs/BENCHMARKS.md, "Decode attention:
     * prefetch in address order"). */
    const int whole = token_stride == nh * 64;
    const int64_t share = 16 * 64;  /* floats of a block per KV head: whole rows split nh ways */
    const int64_t nblocks = (ctx + 15) / 16;
    for (int64_t j0 = 0; j0 < nblocks; j0 += CHUNK_BLOCKS) {
        const int64_t nb = nblocks - j0 < CHUNK_BLOCKS ? nblocks - j0 : CHUNK_BLOCKS;
        const int64_t nt = (j0 + nb) * 16 < ctx ? nb * 16 : ctx - j0 * 16;  /* keys in the chunk */
        for (int64_t jj = 0; jj < nb; jj++) {
            const int64_t j = j0 + jj;
            const int n = ctx - j * 16 < 16 ? (int)(ctx - j * 16) : 16;
            const float *kb = kbase + table[j] * block_stride;
            /* the chunk's last K block prefetches its first V block */
            const float *next = kbase + (jj + 1 < nb ? table[j + 1] * block_stride : table[j0] * block_stride + v_offset);
            for (int h = 0; h < nh; h++)
                score_block8(q[h], kb + h * 64, token_stride, n, sc[h][0] + jj * 16, sc[h][1] + jj * 16,
                             sc[h][2] + jj * 16, next + (whole ? h * share : h * 64),
                             whole ? share / 4 : 4 * token_stride, whole ? share / 16 : token_stride);
        }
        for (int h = 0; h < nh; h++)
            for (int g = 0; g < 3; g++) {
                const __m256 c = _mm256_set1_ps(softmax_chunk8(sc[h][g], nt, &mx[h][g], &l[h][g]));
                for (int d = 0; d < 64; d += 8)
                    _mm256_store_ps(acc[h] + g * 64 + d, _mm256_mul_ps(_mm256_load_ps(acc[h] + g * 64 + d), c));
            }
        for (int64_t jj = 0; jj < nb; jj++) {
            const int64_t j = j0 + jj;
            const int n = ctx - j * 16 < 16 ? (int)(ctx - j * 16) : 16;
            const float *vb = kbase + table[j] * block_stride + v_offset;
            /* the chunk's last V block prefetches the next chunk's first K block, if any */
            const float *next = jj + 1 < nb ? kbase + table[j + 1] * block_stride + v_offset
                                : j + 1 < nblocks ? kbase + table[j + 1] * block_stride : NULL;
            for (int h = 0; h < nh; h++)
                for (int half = 0; half < 2; half++)
                    weigh_half(acc[h], vb + h * 64, token_stride, n, sc[h][0] + jj * 16, sc[h][1] + jj * 16,
                               sc[h][2] + jj * 16, half,
                               next ? next + (whole ? (h * 2 + half) * share / 2 : h * 64 + half * 32) : NULL,
                               whole ? share / 32 : token_stride);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int g = 0; g < 3; g++) {
            const __m256 inv = _mm256_set1_ps(1.f / l[h][g]);
            for (int d = 0; d < 64; d += 8)
                _mm256_storeu_ps(o + h * 192 + g * 64 + d, _mm256_mul_ps(_mm256_load_ps(acc[h] + g * 64 + d), inv));
        }
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
#ifdef __AVX512F__
    const __m512i order = sum_order();
#endif
    /* KV heads per item: all of a sequence's where the sequences alone keep the threads busy
     * (attend_seq, or the AVX2 attend_g3: each reads its blocks' rows whole; fewer, unequal
     * sequences left a thread idle), else one */
    int64_t per = 1;
#ifdef __AVX512F__
    if (group == 3 && head_dim == 64 && block_size == 16 && num_kv_heads <= MAX_KV_HEADS &&
        token_stride == num_kv_heads * head_dim && num_seqs >= 8 * omp_get_max_threads())
        per = num_kv_heads;  /* attend_seq */
#elif defined(__AVX2__) && defined(__FMA__)
    if (group == 3 && head_dim == 64 && block_size == 16 && num_kv_heads <= MAX_KV_HEADS &&
        num_seqs >= 8 * omp_get_max_threads())
        per = num_kv_heads;
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * num_kv_heads / per; item++) {
        const int64_t s = item * per / num_kv_heads, h = item * per % num_kv_heads;
        const int64_t ctx = ctx_lens[s];
        const int64_t *table = tables + table_starts[s];
        const float *qs = q + rows[s] * q_stride + h * group * head_dim;
        float *o = out + rows[s] * heads * head_dim + h * group * head_dim;
#ifdef __AVX512F__
        if (per > 1) {
            attend_seq(base + layer_offset, v_offset, block_stride, token_stride, table, ctx, qs, o, scale,
                       (int)per, order);
            continue;
        }
        if (group == 3 && head_dim == 64 && block_size == 16) {  /* SmolLM2-135M, the default block */
            attend_g3(base + layer_offset + h * head_dim, v_offset, block_stride, token_stride, table, ctx, qs, o,
                      scale, order);
            continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (group == 3 && head_dim == 64 && block_size == 16) {
            attend_g3(base + layer_offset + h * head_dim, v_offset, block_stride, token_stride, table, ctx, qs, o,
                      scale, (int)per);
            continue;
        }
#else
        if (group == 3 && head_dim == 64 && block_size == 16) {
            ATTEND(3, 64, 16);
            continue;
        }
#endif
        if (head_dim == 64)
            ATTEND(group, 64, block_size);
        else if (head_dim == 128)
            ATTEND(group, 128, block_size);
        else
            ATTEND(group, head_dim, block_size);
    }
}
