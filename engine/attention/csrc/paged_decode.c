/* Paged decode attention on CPU, reading K/V where they lie in the paged cache.
 *
 * One query token per sequence (a decode step). For each (sequence, KV head) the kernel walks
 * the sequence's block table, scores the head's `group` query heads against each key of a
 * block, and folds the block into a running softmax (max, sum, weighted V) as flash-decoding
 * does: K/V are read once, in place, never copied into a workspace.
 *
 * Layout (engine/kv_cache.py): element (block b, token t, kv head h, dim d) of layer L's K is at
 *   base + b * block_stride + L * layer_stride + t * token_stride + h * head_dim + d,
 * and V is `v_offset` elements further. All strides are in elements (float32).
 * q: [tokens, heads, head_dim] with row stride q_stride; out: [tokens, heads, head_dim] contiguous.
 * Work items (sequence, KV head) are spread over the OpenMP threads (torch's own runtime: the
 * library is loaded into a process that already holds torch's libgomp).
 */
#include <float.h>
#include <math.h>
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

#define ATTEND(GROUP, HEAD_DIM, BLOCK)                                                                       \
    attend_one(base, block_stride, layer_offset, v_offset, token_stride, qs, o, table, ctx, h, GROUP, HEAD_DIM, \
               BLOCK, scale)

void paged_decode_f32(const float *base, int64_t block_stride, int64_t layer_offset, int64_t v_offset,
                      int64_t token_stride, const float *q, int64_t q_stride, float *out,
                      const int64_t *rows, const int64_t *ctx_lens, const int64_t *tables,
                      const int64_t *table_starts, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                      int64_t head_dim, int64_t block_size, float scale) {
    const int64_t heads = num_kv_heads * group;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t ctx = ctx_lens[s];
        const int64_t *table = tables + table_starts[s];
        const float *qs = q + rows[s] * q_stride + h * group * head_dim;
        float *o = out + rows[s] * heads * head_dim + h * group * head_dim;
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
