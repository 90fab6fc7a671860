/* Attention of n new query rows over a bfloat16 KV cache, one call for all rows and heads.
 *
 * Row j (position start + j) of head h attends over keys 0..start + j of its key-value head
 * h / (heads / kv_heads), and every row is computed by the same code in the same order,
 * whatever n is: so a verify pass gives each token the bits a one-token step gives it (a
 * batched, masked attention sums rows of another length, which rounds differently). Written in
 * vec16.h's 16-lane vectors, with its fixed reduction trees and explicit fused multiply-adds:
 * every variant gives the same bits.
 * A task is one row and one key-value head: each block of 16 keys (and of values) is widened
 * to float32 once for the query heads that share it.
 *   q [heads][n][d] float32 (RoPE applied), keys and values [kv_heads][capacity][d] bf16,
 *   out [n][heads][d] float32; d % 32 == 0, d <= MAX_HEAD_DIM, heads / kv_heads <= MAX_SHARED.
 * Returns 0, -1 when memory could not be had, -2 for a shape it does not take.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec16.h"

/* Scores of 16 keys (widened in ``wide`` [16][d]) for one query row: 16 accumulators that
 * stay in registers, reduced together. */
ALWAYS_INLINE V16 scores16(const float *qv, const float *wide, int64_t d) {
    V16 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = v_zero();
    for (int64_t c = 0; c < d; c += 16) {
        const V16 qc = v_load(qv + c);
        for (int t = 0; t < 16; t++) acc[t] = v_fma(qc, v_load(wide + t * d + c), acc[t]);
    }
    return v_sum16x16(acc);
}

/* The queries of one row, in v_widen32's order (even elements of each 32, then odd ones). */
static void gather_queries(const float *q, int64_t kv, int64_t shared, int64_t n, int64_t j,
                           int64_t d, float *qs) {
    for (int64_t hh = 0; hh < shared; hh++) {
        const float *qh = q + ((kv * shared + hh) * n + j) * d;
        for (int64_t c = 0; c < d; c += 32)
            for (int i = 0; i < 16; i++) {
                qs[hh * d + c + i] = qh[c + 2 * i];
                qs[hh * d + c + 16 + i] = qh[c + 2 * i + 1];
            }
    }
}

/* One task: row j over keys 0..len-1 of key-value head kv, for the query heads sharing it.
 * p [shared][stride], wide [16][d] and qs [shared][d] are the thread's scratch. */
static void attend_one(const float *q, const uint16_t *kb, const uint16_t *vb, int64_t kv,
                       int64_t j, int64_t len, int64_t n, int64_t shared, int64_t d,
                       int64_t stride, float scale, float *o, float *p, float *wide, float *qs) {
    gather_queries(q, kv, shared, n, j, d, qs);
    /* scores, 16 keys at a time; a last partial block is padded with zero keys */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        for (int64_t t = 0; t < 16; t++)
            for (int64_t c = 0; c < d; c += 32) {
                if (t0 + t < len) {
                    v_widen32(kb + (t0 + t) * d + c, wide + t * d + c);
                } else {
                    v_store(wide + t * d + c, v_zero());
                    v_store(wide + t * d + c + 16, v_zero());
                }
            }
        for (int64_t hh = 0; hh < shared; hh++)
            v_store(p + hh * stride + t0, v_mul(scores16(qs + hh * d, wide, d), v_set1(scale)));
    }
    /* softmax weights in place, zero past len; the sums */
    float total[MAX_SHARED];
    for (int64_t hh = 0; hh < shared; hh++) {
        float *ph = p + hh * stride;
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) top = ph[t] > top ? ph[t] : top;
        V16 sum = v_zero();
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            const V16 e = v_keep(v_exp(v_sub(v_load(ph + t0), v_set1(top))), len - t0);
            v_store(ph + t0, e);
            sum = v_add(sum, e);
        }
        total[hh] = v_sum(sum);
        for (int64_t c = 0; c < d; c += 16) v_store(o + hh * d + c, v_zero());
    }
    /* the weighted values, key by key in order, 16 values widened at a time */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t block = len - t0 < 16 ? len - t0 : 16;
        for (int64_t t = 0; t < block; t++)
            for (int64_t c = 0; c < d; c += 32) v_widen32(vb + (t0 + t) * d + c, wide + t * d + c);
        for (int64_t hh = 0; hh < shared; hh++) {
            const float *ph = p + hh * stride + t0;
            for (int64_t c = 0; c < d; c += 16) {
                V16 acc = v_load(o + hh * d + c);
                for (int64_t t = 0; t < block; t++)
                    acc = v_fma(v_set1(ph[t]), v_load(wide + t * d + c), acc);
                v_store(o + hh * d + c, acc);
            }
        }
    }
    for (int64_t hh = 0; hh < shared; hh++)  /* back to the natural order */
        for (int64_t c = 0; c < d; c += 32) {
            float even[16], odd[16];
            v_store(even, v_div(v_load(o + hh * d + c), v_set1(total[hh])));
            v_store(odd, v_div(v_load(o + hh * d + c + 16), v_set1(total[hh])));
            for (int i = 0; i < 16; i++) {
                o[hh * d + c + 2 * i] = even[i];
                o[hh * d + c + 2 * i + 1] = odd[i];
            }
        }
}

int attend_rows(const float *q, const uint16_t *keys, const uint16_t *values, int64_t capacity,
                int64_t start, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                float scale, float *out, int threads) {
    if (kv_heads <= 0 || d % 32 || d > MAX_HEAD_DIM || heads % kv_heads) return -2;
    const int64_t shared = heads / kv_heads;
    if (shared > MAX_SHARED) return -2;
    const int64_t stride = (start + n + 15) / 16 * 16;  /* one head's scores, padded */
    int failed = 0;
    (void)threads;  /* unused where there is no OpenMP */
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (size_t)(stride * shared));
        float *wide = malloc(sizeof(float) * (size_t)(16 * d));  /* 16 keys or values */
        float *qs = malloc(sizeof(float) * (size_t)(shared * d));  /* one row's queries */
        if (!p || !wide || !qs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * n; task++) {
            if (!p || !wide || !qs) continue;
            const int64_t kv = task / n, j = task % n;
            attend_one(q, keys + kv * capacity * d, values + kv * capacity * d, kv, j,
                       start + j + 1, n, shared, d, stride, scale,
                       out + (j * heads + kv * shared) * d, p, wide, qs);
        }
        free(p);
        free(wide);
        free(qs);
    }
    return failed ? -1 : 0;
}
