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
 * attend_tree: the n new rows form a tree (parents[j] < j is the row of j's parent, -1 for
 * row 0, the root): row j attends keys 0..start-1, then the new rows on its root path in depth
 * order, then itself. The prefix's last partial block of 16 and the path's keys and values
 * are gathered into scratch, so that each row sees the same 16-key blocks, in the same order,
 * as the chain of its root path fed alone: a node's output is bit for bit that chain's row.
 * Returns 0, -1 when memory could not be had, -2 for a shape (or parents) it does not take.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* One task: row j over keys 0..len-1 of key-value head kv, for the query heads sharing it;
 * keys and values from ``base`` on (a multiple of 16) are read from kt, vt instead of kb, vb.
 * p [shared][stride], wide [16][d] and qs [shared][d] are the thread's scratch. */
static void attend_one(const float *q, const uint16_t *kb, const uint16_t *vb,
                       const uint16_t *kt, const uint16_t *vt, int64_t base, int64_t kv,
                       int64_t j, int64_t len, int64_t n, int64_t shared, int64_t d,
                       int64_t stride, float scale, float *o, float *p, float *wide, float *qs) {
    gather_queries(q, kv, shared, n, j, d, qs);
    /* scores, 16 keys at a time; a last partial block is padded with zero keys */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint16_t *keys = t0 < base ? kb + t0 * d : kt + (t0 - base) * d;
        for (int64_t t = 0; t < 16; t++)
            for (int64_t c = 0; c < d; c += 32) {
                if (t0 + t < len) {
                    v_widen32(keys + t * d + c, wide + t * d + c);
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
        const uint16_t *vals = t0 < base ? vb + t0 * d : vt + (t0 - base) * d;
        for (int64_t t = 0; t < block; t++)
            for (int64_t c = 0; c < d; c += 32) v_widen32(vals + t * d + c, wide + t * d + c);
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

/* Row j's root path (rows, root first) into path; returns its depth. */
static int64_t root_path(const int64_t *parents, int64_t j, int64_t *path) {
    int64_t depth = 0;
    for (int64_t r = j; r > 0; r = parents[r]) depth++;
    for (int64_t r = j, i = depth; i >= 0; i--) {
        path[i] = r;
        r = i ? parents[r] : 0;
    }
    return depth;
}

/* Whether ``parents`` (NULL: a chain) is a tree as attend_tree takes it: -1 for row 0, then
 * each row's parent an earlier row. */
static int parents_ok(const int64_t *parents, int64_t n) {
    for (int64_t j = 0; parents && j < n; j++)
        if (j == 0 ? parents[0] != -1 : parents[j] < 0 || parents[j] >= j) return 0;
    return 1;
}

/* A chain (parents NULL) or a tree of n new rows. */
static int attend_any(const float *q, const uint16_t *keys, const uint16_t *values,
                      int64_t capacity, int64_t start, int64_t n, const int64_t *parents,
                      int64_t heads, int64_t kv_heads, int64_t d, float scale, float *out,
                      int threads) {
    if (kv_heads <= 0 || d % 32 || d > MAX_HEAD_DIM || heads % kv_heads) return -2;
    if (n < 0 || start < 0 || !parents_ok(parents, n)) return -2;
    if (n == 0) return 0;
    const int64_t shared = heads / kv_heads;
    if (shared > MAX_SHARED) return -2;
    const int64_t stride = (start + n + 15) / 16 * 16;  /* one head's scores, padded */
    const int64_t base = parents ? start / 16 * 16 : INT64_MAX;  /* gathered from here on */
    const int64_t tail = parents ? (start - base + n) * d : 0;  /* gathered keys' elements */
    int failed = 0;
    (void)threads;  /* unused where there is no OpenMP */
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (size_t)(stride * shared));
        float *wide = malloc(sizeof(float) * (size_t)(16 * d));  /* 16 keys or values */
        float *qs = malloc(sizeof(float) * (size_t)(shared * d));  /* one row's queries */
        uint16_t *kt = parents ? malloc(sizeof(uint16_t) * (size_t)(2 * tail)) : NULL;
        int64_t *path = parents ? malloc(sizeof(int64_t) * (size_t)n) : NULL;
        const int ok = p && wide && qs && (!parents || (kt && path));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * n; task++) {
            if (!ok) continue;
            const int64_t kv = task / n, j = task % n;
            const uint16_t *kb = keys + kv * capacity * d, *vb = values + kv * capacity * d;
            int64_t len = start + j + 1;
            if (parents) {  /* the prefix's partial block, then the path, in depth order */
                const int64_t depth = root_path(parents, j, path), head = start - base;
                uint16_t *vt = kt + tail;
                memcpy(kt, kb + base * d, sizeof(uint16_t) * (size_t)(head * d));
                memcpy(vt, vb + base * d, sizeof(uint16_t) * (size_t)(head * d));
                for (int64_t i = 0; i <= depth; i++) {
                    memcpy(kt + (head + i) * d, kb + (start + path[i]) * d,
                           sizeof(uint16_t) * (size_t)d);
                    memcpy(vt + (head + i) * d, vb + (start + path[i]) * d,
                           sizeof(uint16_t) * (size_t)d);
                }
                len = start + depth + 1;
            }
            attend_one(q, kb, vb, kt, kt + tail, base, kv, j, len, n, shared, d, stride, scale,
                       out + (j * heads + kv * shared) * d, p, wide, qs);
        }
        free(p);
        free(wide);
        free(qs);
        free(kt);
        free(path);
    }
    return failed ? -1 : 0;
}

int attend_rows(const float *q, const uint16_t *keys, const uint16_t *values, int64_t capacity,
                int64_t start, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                float scale, float *out, int threads) {
    return attend_any(q, keys, values, capacity, start, n, NULL, heads, kv_heads, d, scale,
                      out, threads);
}

int attend_tree(const float *q, const uint16_t *keys, const uint16_t *values, int64_t capacity,
                int64_t start, int64_t n, const int64_t *parents, int64_t heads,
                int64_t kv_heads, int64_t d, float scale, float *out, int threads) {
    if (!parents) return -2;
    return attend_any(q, keys, values, capacity, start, n, parents, heads, kv_heads, d, scale,
                      out, threads);
}
