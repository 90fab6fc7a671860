/* The whole decoder stack of a Llama-family model (Qwen2: q/k/v biases; Qwen3: an RMSNorm of
 * every query and key head before RoPE) in one call, for a few new tokens: RMSNorm, the
 * quantized projections (kquant_matmul.c), RoPE, the bf16 KV
 * cache write, attend_rows (attention.c), SwiGLU and both residual adds. The same work as the
 * Python loop over layers, without its ~35 tensor calls a layer (about 9 ms of a 1.5B
 * one-token step, 20 ms of a 16-token pass, and a larger share of a 0.5B draft's step). Every
 * step is row by row in a fixed order, so a row's result does not depend on the other rows of
 * the call; every float operation is one vec16.h or plain C operation, fused only where the
 * code says fma32 / v_fma, so every variant gives the same bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec16.h"

static int64_t fused_width(const KFused *f) {
    int64_t width = 0;
    for (int64_t i = 0; i < f->parts; i++) width += f->part[i].n;
    return width;
}

/* y [m, width] = x [m, k] times the parts, each with its bias; -1 when memory ran out. */
static int fused_linear(const KFused *f, const float *x, int64_t m, int64_t k, float *y,
                        int threads) {
    const int64_t width = fused_width(f);
    Scratch s;
    int ok = scratch_make(&s, x, m, k, 1, threads) == 0;
    for (int64_t i = 0, at = 0; ok && i < f->parts; at += f->part[i].n, i++) {
        const KPart *p = &f->part[i];
        if (p->kind == KIND_Q4_K || p->kind == KIND_Q5_K || p->kind == KIND_Q3_M)
            kquant_run(&s, p->kind == KIND_Q3_M ? 3 : (int)p->kind, m, k, p->t[0], p->t[1],
                       p->t[2], p->t[3], p->t[4], p->n, y + at, width, threads);
        else if (p->kind == KIND_Q8_0 || p->kind == KIND_Q4_0)
            q32_run(&s, p->kind == KIND_Q8_0 ? 8 : 4, m, k, p->t[0], p->t[1], p->n, y + at,
                    width, threads);
        else
            q6k_run(&s, m, k, p->t[0], p->t[1], p->t[2], p->t[3], p->n, y + at, width, threads);
        for (int64_t r = 0; p->bias && r < m; r++)
            for (int64_t c = 0; c < p->n; c++) y[r * width + at + c] += p->bias[c];
    }
    scratch_free(&s);
    return ok ? 0 : -1;
}

/* out [m, k] = x / sqrt(mean(x^2) + eps) * w, row by row (k % 16 == 0). */
static void rms_norm(const float *x, const float *w, int64_t m, int64_t k, float eps,
                     float *out) {
    for (int64_t r = 0; r < m; r++) {
        V16 acc = v_zero();
        for (int64_t c = 0; c < k; c += 16) {
            const V16 v = v_load(x + r * k + c);
            acc = v_fma(v, v, acc);
        }
        const V16 inv = v_set1(1.0f / sqrtf(v_sum(acc) / (float)k + eps));
        for (int64_t c = 0; c < k; c += 16)
            v_store(out + r * k + c, v_mul(v_mul(v_load(x + r * k + c), inv), v_load(w + c)));
    }
}

static inline uint16_t bf16_round(float f) {  /* round to nearest even, as torch's cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* t [d] rotated by RoPE with cos, sin [d] (the halves convention of rotate_half). */
static inline void rope(const float *t, const float *cos, const float *sin, int64_t d,
                        float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float turned = i < half ? -t[i + half] : t[i - half];
        out[i] = fma32(t[i], cos[i], turned * sin[i]);
    }
}

/* a [m, inter] = SiLU(gate) * up from gu [m, 2 * inter]: g / (1 + exp(-g)) computed as
 * (g < 0 ? g * e : g) / (1 + e) with e = exp(-|g|) <= 1 (v_exp takes only x <= 0). */
static void swiglu(const float *gu, int64_t m, int64_t inter, float *a, int threads) {
    (void)threads;  /* unused where there is no OpenMP */
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < inter; c += 16) {
            const V16 g = v_load(gu + r * 2 * inter + c);
            const V16 u = v_load(gu + r * 2 * inter + inter + c);
            const V16 e = v_exp(v_neg_abs(g));
            const V16 top = v_select(v_less(g, v_zero()), v_mul(g, e), g);
            v_store(a + r * inter + c, v_mul(v_div(top, v_add(v_set1(1.0f), e)), u));
        }
}

/* Queries of every row as attend_rows takes them, RoPE'd; the keys (RoPE'd) and values
 * written to the layer's cache slots start.. as bf16. Where the layer has q_norm / k_norm
 * (Qwen3), each query and key head is RMS-normed over its head_dim values first. */
static void rope_and_cache(const KModel *M, const KLayer *L, const KStep *S, const float *qkv,
                           uint16_t *kc, uint16_t *vc, float *qrows) {
    const int64_t d = M->head_dim, q_size = M->heads * d, kv_size = M->kv_heads * d;
    float turned[MAX_HEAD_DIM], normed[MAX_HEAD_DIM];  /* d <= MAX_HEAD_DIM, d % 16 == 0:
                                                           checked by decoder_forward */
    for (int64_t r = 0; r < S->n; r++) {
        const float *row = qkv + r * (q_size + 2 * kv_size);
        const float *cos = S->cos + r * d, *sin = S->sin + r * d;
        for (int64_t hd = 0; hd < M->heads; hd++) {
            const float *q = row + hd * d;
            if (L->q_norm) {
                rms_norm(q, L->q_norm, 1, d, M->eps, normed);
                q = normed;
            }
            rope(q, cos, sin, d, qrows + (hd * S->n + r) * d);
        }
        for (int64_t kv = 0; kv < M->kv_heads; kv++) {
            uint16_t *kslot = kc + (kv * S->capacity + S->start + r) * d;
            uint16_t *vslot = vc + (kv * S->capacity + S->start + r) * d;
            const float *k = row + q_size + kv * d;
            if (L->k_norm) {
                rms_norm(k, L->k_norm, 1, d, M->eps, normed);
                k = normed;
            }
            rope(k, cos, sin, d, turned);
            for (int64_t c = 0; c < d; c++) {
                kslot[c] = bf16_round(turned[c]);
                vslot[c] = bf16_round(row[q_size + kv_size + kv * d + c]);
            }
        }
    }
}

/* One sequence's part of a layer's attention: its rows' queries (qkv rows r0..r0+n of the
 * batch) RoPE'd, its keys and values written to its own cache, attention over its own cache
 * (a chain or its tree) into attn's rows r0... */
static int attend_step(const KModel *M, const KStep *S, int64_t layer, int64_t r0,
                       const float *qkv, float *qrows, float *attn, int threads) {
    const int64_t d = M->head_dim, q_size = M->heads * d, kv_size = M->kv_heads * d;
    uint16_t *kc = S->keys + layer * M->kv_heads * S->capacity * d;
    uint16_t *vc = S->values + layer * M->kv_heads * S->capacity * d;
    rope_and_cache(M, &M->layers[layer], S, qkv + r0 * (q_size + 2 * kv_size), kc, vc, qrows);
    float *out = attn + r0 * q_size;
    return S->parents
        ? attend_tree(qrows, kc, vc, S->capacity, S->start, S->n, S->parents, M->heads,
                      M->kv_heads, d, M->scale, out, threads)
        : attend_rows(qrows, kc, vc, S->capacity, S->start, S->n, M->heads, M->kv_heads, d,
                      M->scale, out, threads);
}

/* steps[s]: one sequence's rows (its own cache, start, cos and sin, tree, features); their x
 * are consecutive slices of one buffer (steps[s + 1].x == steps[s].x + n_s * hidden), which
 * holds the embeddings in and the last layer's output (before the final norm) out. The
 * projections, norms and SwiGLU run over all rows at once; RoPE, the cache writes and
 * attention per sequence, each over its own cache. Every operation is row by row, so each
 * row's result is the bits its sequence's step alone gives it (tests check it). Each
 * sequence's keys and values at its positions start.. are written to its cache; its features
 * receive the hidden states entering its feature_layers. Rows that form a tree (parents)
 * attend along their root paths; their positions are in cos and sin (start + depth). */
int decoder_forward_batch(const KModel *model, const KStep *steps, int64_t count,
                          int threads) {
    const KModel *M = model;
    const int64_t hidden = M->hidden, d = M->head_dim, inter = M->intermediate;
    const int64_t q_size = M->heads * d, kv_size = M->kv_heads * d;
    if (d % 32 || d > MAX_HEAD_DIM || hidden % 16 || inter % 16 || M->kv_heads <= 0
        || count < 1)
        return -2;  /* attend_rows' limits and the norms' vectors, checked before any write */
    int64_t n = 0, widest = 0;
    for (int64_t s = 0; s < count; s++) {
        if (steps[s].x != steps[0].x + n * hidden || steps[s].n < 0) return -2;
        n += steps[s].n;
        widest = steps[s].n > widest ? steps[s].n : widest;
    }
    float *h = malloc(sizeof(float) * (size_t)(n * hidden));  /* a norm's or a projection's */
    float *qkv = malloc(sizeof(float) * (size_t)(n * (q_size + 2 * kv_size)));
    float *qrows = malloc(sizeof(float) * (size_t)(widest * q_size));  /* one sequence's */
    float *attn = malloc(sizeof(float) * (size_t)(n * q_size));
    float *gu = malloc(sizeof(float) * (size_t)(n * 2 * inter));
    float *a = malloc(sizeof(float) * (size_t)(n * inter));
    float *x = steps[0].x;
    int status = h && qkv && qrows && attn && gu && a ? 0 : -1;
    for (int64_t i = 0; status == 0 && i < M->n_layers; i++) {
        const KLayer *L = &M->layers[i];
        for (int64_t s = 0; s < count; s++) {
            const KStep *S = &steps[s];
            for (int64_t f = 0; f < S->count; f++)
                if (S->feature_layers[f] == i)
                    for (int64_t r = 0; r < S->n; r++)
                        memcpy(S->features + (r * S->count + f) * hidden, S->x + r * hidden,
                               sizeof(float) * (size_t)hidden);
        }
        rms_norm(x, L->norm1, n, hidden, M->eps, h);
        if ((status = fused_linear(&L->qkv, h, n, hidden, qkv, threads))) break;
        for (int64_t s = 0, r0 = 0; status == 0 && s < count; r0 += steps[s].n, s++)
            status = attend_step(M, &steps[s], i, r0, qkv, qrows, attn, threads);
        if (status) break;
        if ((status = fused_linear(&L->o, attn, n, q_size, h, threads))) break;
        for (int64_t e = 0; e < n * hidden; e++) x[e] += h[e];
        rms_norm(x, L->norm2, n, hidden, M->eps, h);
        if ((status = fused_linear(&L->gate_up, h, n, hidden, gu, threads))) break;
        swiglu(gu, n, inter, a, threads);
        if ((status = fused_linear(&L->down, a, n, inter, h, threads))) break;
        for (int64_t e = 0; e < n * hidden; e++) x[e] += h[e];
    }
    free(h);
    free(qkv);
    free(qrows);
    free(attn);
    free(gu);
    free(a);
    return status;
}

/* One sequence's rows: decoder_forward_batch of one step. */
int decoder_forward(const KModel *model, const KStep *step, int threads) {
    return decoder_forward_batch(model, step, 1, threads);
}
