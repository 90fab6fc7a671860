/* A vector of 16 floats, the unit the attention, the norms and SwiGLU are written in: one zmm
 * register with AVX-512, two ymm registers with AVX2, an array in the portable build.
 *
 * Each operation is exact lane by lane (an IEEE float operation, a bit operation or data
 * movement), so the three implementations give the same bits: v_fma is one fused multiply-add
 * (an FMA instruction, or fma32 below), never a multiply and an add; the reductions (v_sum,
 * v_sum16x16) add in one fixed tree; v_pow2 converts as CVTTPS2DQ does (NaN and out of range:
 * INT32_MIN). Code built on these, such as v_exp below, is shared by all variants.
 */
#ifndef LOCALSPEC_VEC16_H
#define LOCALSPEC_VEC16_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* a * b + c rounded once, as an FMA instruction does. Where the target has no FMA (x86 built
 * without -mfma: the portable variant there), C's fmaf is a library call for every element;
 * this computes the same bits inline. The product of two floats is exact in
 * double; the sum s with c is made round-to-odd in 53 bits (TwoSum gives the rounding error e:
 * when inexact, s is stepped down to the value below the exact sum in magnitude and its last
 * bit set), and rounding that to nearest in 24 bits is rounding the exact value to nearest once
 * (Boldo and Melquiond, 2008). Inf and NaN pass through unchanged. */
ALWAYS_INLINE float fma32(float a, float b, float c) {
#if defined(FP_FAST_FMAF) || defined(__FMA__)
    return fmaf(a, b, c);
#else
    const double p = (double)a * (double)b, s = p + (double)c;
    const double moved = s - p, e = (p - (s - moved)) + ((double)c - moved);
    const uint64_t inexact = (uint64_t)(e != 0.0 && fabs(s) <= DBL_MAX);
    const uint64_t above = (uint64_t)((e < 0.0) == (s > 0.0));  /* |s| > |exact|, if inexact */
    uint64_t bits;
    memcpy(&bits, &s, 8);
    bits = (bits - (inexact & above)) | inexact;
    double odd;
    memcpy(&odd, &bits, 8);
    return (float)odd;
#endif
}

#if defined(KERNELS_AVX512)
#include <immintrin.h>

typedef __m512 V16;
typedef __mmask16 M16;

ALWAYS_INLINE V16 v_zero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE V16 v_set1(float a) { return _mm512_set1_ps(a); }
ALWAYS_INLINE V16 v_load(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void v_store(float *p, V16 v) { _mm512_storeu_ps(p, v); }
ALWAYS_INLINE V16 v_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE V16 v_sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE V16 v_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE V16 v_div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
ALWAYS_INLINE V16 v_fma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE V16 v_fnma(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }
ALWAYS_INLINE M16 v_less(V16 a, V16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
ALWAYS_INLINE V16 v_select(M16 m, V16 a, V16 b) { return _mm512_mask_blend_ps(m, b, a); }
ALWAYS_INLINE V16 v_neg_abs(V16 a) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a),
                                               _mm512_set1_epi32(INT32_MIN)));
}
ALWAYS_INLINE V16 v_pow2(V16 n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
ALWAYS_INLINE V16 v_keep(V16 v, int64_t count) {  /* lanes count.. zeroed */
    const uint32_t lanes = count <= 0 ? 0u : count >= 16 ? 0xFFFFu : (1u << count) - 1u;
    return _mm512_maskz_mov_ps((__mmask16)lanes, v);
}
/* 32 bf16 values widened to float32 without a shuffle: the even-numbered ones to dst[0..15],
 * the odd-numbered ones to dst[16..31]. */
ALWAYS_INLINE void v_widen32(const uint16_t *src, float *dst) {
    const __m512i pairs = _mm512_loadu_si512((const void *)src);
    _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
    _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(
        _mm512_and_si512(pairs, _mm512_set1_epi32((int32_t)0xFFFF0000u))));
}
/* Lane i: the sum of v[i]'s lanes in v_sum's tree. */
ALWAYS_INLINE V16 v_sum16x16(const V16 *v) {
    V16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* lanes 0..7: v[2i]'s halves added; 8..15: v[2i + 1]'s */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    const __m512i even2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i odd2 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * i], even2, b[2 * i + 1]),
                             _mm512_permutex2var_ps(b[2 * i], odd2, b[2 * i + 1]));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(c[0], even, c[1]),
                         _mm512_permutex2var_ps(c[0], odd, c[1]));
}

#elif defined(KERNELS_AVX2)
#include <immintrin.h>

typedef struct { __m256 lo, hi; } V16;  /* lanes 0..7, 8..15 */
typedef V16 M16;                        /* all ones where true */

#define V16_EACH(expr_lo, expr_hi) { expr_lo, expr_hi }
ALWAYS_INLINE V16 v_zero(void) { return (V16)V16_EACH(_mm256_setzero_ps(), _mm256_setzero_ps()); }
ALWAYS_INLINE V16 v_set1(float a) { return (V16)V16_EACH(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
ALWAYS_INLINE V16 v_load(const float *p) {
    return (V16)V16_EACH(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
ALWAYS_INLINE void v_store(float *p, V16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
#define V16_BINARY(name, op) \
    ALWAYS_INLINE V16 name(V16 a, V16 b) { return (V16)V16_EACH(op(a.lo, b.lo), op(a.hi, b.hi)); }
V16_BINARY(v_add, _mm256_add_ps)
V16_BINARY(v_sub, _mm256_sub_ps)
V16_BINARY(v_mul, _mm256_mul_ps)
V16_BINARY(v_div, _mm256_div_ps)
ALWAYS_INLINE V16 v_fma(V16 a, V16 b, V16 c) {
    return (V16)V16_EACH(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
ALWAYS_INLINE V16 v_fnma(V16 a, V16 b, V16 c) {
    return (V16)V16_EACH(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
ALWAYS_INLINE M16 v_less(V16 a, V16 b) {
    return (V16)V16_EACH(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ));
}
ALWAYS_INLINE V16 v_select(M16 m, V16 a, V16 b) {
    return (V16)V16_EACH(_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi));
}
ALWAYS_INLINE V16 v_neg_abs(V16 a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return (V16)V16_EACH(_mm256_or_ps(a.lo, sign), _mm256_or_ps(a.hi, sign));
}
ALWAYS_INLINE __m256 pow2_8(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
ALWAYS_INLINE V16 v_pow2(V16 n) { return (V16)V16_EACH(pow2_8(n.lo), pow2_8(n.hi)); }
ALWAYS_INLINE V16 v_keep(V16 v, int64_t count) {  /* lanes count.. zeroed */
    count = count < 0 ? 0 : count > 16 ? 16 : count;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)count), lane);
    const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)count - 8), lane);
    return (V16)V16_EACH(_mm256_and_ps(v.lo, _mm256_castsi256_ps(lo)),
                         _mm256_and_ps(v.hi, _mm256_castsi256_ps(hi)));
}
ALWAYS_INLINE void v_widen32(const uint16_t *src, float *dst) {
    const __m256i mask = _mm256_set1_epi32((int32_t)0xFFFF0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i pairs = _mm256_loadu_si256((const void *)(src + 16 * h));
        _mm256_storeu_ps(dst + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)));
        _mm256_storeu_ps(dst + 16 + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(pairs, mask)));
    }
}
/* The totals of v[0..7] in order, each in v_sum's tree: first halves (h8), then quarters
 * (h4) of two vectors at a time, then (h4[0] + h4[2]) + (h4[1] + h4[3]). */
ALWAYS_INLINE __m256 sum8(const V16 *v) {
    __m256 h8[8], b[4], c[2];
    for (int i = 0; i < 8; i++) h8[i] = _mm256_add_ps(v[i].lo, v[i].hi);
    for (int i = 0; i < 4; i++)  /* [h4 of v[i] | h4 of v[i + 4]] */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(h8[i], h8[i + 4], 0x20),
                             _mm256_permute2f128_ps(h8[i], h8[i + 4], 0x31));
    for (int i = 0; i < 2; i++)  /* [s, t of v[2i], s, t of v[2i + 1] | the same of + 4] */
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
}
ALWAYS_INLINE V16 v_sum16x16(const V16 *v) { return (V16)V16_EACH(sum8(v), sum8(v + 8)); }

#else  /* portable: plain C11, no intrinsics, no vector extensions */

typedef struct { float f[16]; } V16;
typedef struct { int32_t m[16]; } M16;  /* 1 where true */

#define V16_LANES(result, expr) \
    do { for (int i_ = 0; i_ < 16; i_++) (result).f[i_] = (expr); } while (0)
ALWAYS_INLINE V16 v_set1(float a) { V16 r; V16_LANES(r, a); return r; }
ALWAYS_INLINE V16 v_zero(void) { return v_set1(0.0f); }
ALWAYS_INLINE V16 v_load(const float *p) { V16 r; memcpy(r.f, p, sizeof r.f); return r; }
ALWAYS_INLINE void v_store(float *p, V16 v) { memcpy(p, v.f, sizeof v.f); }
ALWAYS_INLINE V16 v_add(V16 a, V16 b) { V16 r; V16_LANES(r, a.f[i_] + b.f[i_]); return r; }
ALWAYS_INLINE V16 v_sub(V16 a, V16 b) { V16 r; V16_LANES(r, a.f[i_] - b.f[i_]); return r; }
ALWAYS_INLINE V16 v_mul(V16 a, V16 b) { V16 r; V16_LANES(r, a.f[i_] * b.f[i_]); return r; }
ALWAYS_INLINE V16 v_div(V16 a, V16 b) { V16 r; V16_LANES(r, a.f[i_] / b.f[i_]); return r; }
ALWAYS_INLINE V16 v_fma(V16 a, V16 b, V16 c) {
    V16 r;
    V16_LANES(r, fma32(a.f[i_], b.f[i_], c.f[i_]));
    return r;
}
ALWAYS_INLINE V16 v_fnma(V16 a, V16 b, V16 c) {  /* -(a * b) + c, rounded once */
    V16 r;
    V16_LANES(r, fma32(-a.f[i_], b.f[i_], c.f[i_]));
    return r;
}
ALWAYS_INLINE M16 v_less(V16 a, V16 b) {
    M16 m;
    for (int i = 0; i < 16; i++) m.m[i] = a.f[i] < b.f[i];
    return m;
}
ALWAYS_INLINE V16 v_select(M16 m, V16 a, V16 b) {
    V16 r;
    V16_LANES(r, m.m[i_] ? a.f[i_] : b.f[i_]);
    return r;
}
ALWAYS_INLINE float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
ALWAYS_INLINE uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
ALWAYS_INLINE V16 v_neg_abs(V16 a) {
    V16 r;
    V16_LANES(r, bits_float(float_bits(a.f[i_]) | 0x80000000u));
    return r;
}
ALWAYS_INLINE int32_t truncate_like_cvttps(float f) {  /* NaN and out of range: INT32_MIN */
    return f >= -2147483648.0f && f < 2147483648.0f ? (int32_t)f : INT32_MIN;
}
ALWAYS_INLINE V16 v_pow2(V16 n) {  /* ((int)n + 127) << 23, wrapping as the SIMD lanes do */
    V16 r;
    V16_LANES(r, bits_float(((uint32_t)truncate_like_cvttps(n.f[i_]) + 127u) << 23));
    return r;
}
ALWAYS_INLINE V16 v_keep(V16 v, int64_t count) {  /* lanes count.. zeroed */
    for (int64_t i = count < 0 ? 0 : count; i < 16; i++) v.f[i] = 0.0f;
    return v;
}
ALWAYS_INLINE void v_widen32(const uint16_t *src, float *dst) {
    for (int i = 0; i < 16; i++) {
        dst[i] = bits_float((uint32_t)src[2 * i] << 16);
        dst[16 + i] = bits_float((uint32_t)src[2 * i + 1] << 16);
    }
}
ALWAYS_INLINE float v_sum(V16 v);
ALWAYS_INLINE V16 v_sum16x16(const V16 *v) {
    V16 r;
    V16_LANES(r, v_sum(v[i_]));
    return r;
}
#endif

/* The sum of v's lanes, in the tree every variant uses: halves, quarters, then
 * (q[0] + q[2]) + (q[1] + q[3]). */
ALWAYS_INLINE float v_sum(V16 v) {
    float lanes[16], h8[8], h4[4];
    v_store(lanes, v);
    for (int i = 0; i < 8; i++) h8[i] = lanes[i] + lanes[i + 8];
    for (int i = 0; i < 4; i++) h4[i] = h8[i] + h8[i + 4];
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* exp(x) for x <= 0 (scores minus their maximum, -|g| in SwiGLU): 2^n * p(r), Cephes'
 * polynomial; below -87 it is flushed to 0. */
ALWAYS_INLINE V16 v_exp(V16 x) {
    const V16 magic = v_set1(12582912.0f);  /* 1.5 * 2^23: rounds to an integer */
    const V16 low = v_set1(-87.0f);
    const M16 dead = v_less(x, low);
    x = v_select(dead, low, x);
    const V16 n = v_sub(v_fma(x, v_set1(1.44269504088896341f), magic), magic);
    V16 r = v_fnma(n, v_set1(0.693359375f), x);
    r = v_fnma(n, v_set1(-2.12194440e-4f), r);
    V16 p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_add(v_fma(v_mul(p, r), r, r), v_set1(1.0f));  /* p r^2 + r + 1 */
    return v_select(dead, v_zero(), v_mul(p, v_pow2(n)));
}

#endif
