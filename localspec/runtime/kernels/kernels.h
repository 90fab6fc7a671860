/* The native kernels of LocalSpec's quantized CPU forward: the one header of the library.
 *
 * What the library holds, by file:
 *   kquant_matmul.c  products over GGUF Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 weights and LocalSpec's
 *                    own 3-bit Q3_M (activations quantized to int8 here); the
 *                    per-instruction-set inner loops are
 *                    kquant_<variant>.h, and what those share kquant_common.h
 *   attention.c      attention of new query rows over a bf16 KV cache (attend_rows, attend_tree)
 *   decoder_stack.c  the whole decoder stack of a Llama-family model in one call, over one
 *                    sequence's rows or several sequences' at once
 *   abi.c            what the loader checks before any use: ABI version, struct layouts
 *   vec16.h          the 16-lane float vector those are written in, one implementation per
 *                    variant
 *
 * Variants, chosen at build time (one macro): KERNELS_AVX512 (AVX-512 VNNI), KERNELS_AVX2
 * (AVX2 with FMA) and the portable one (neither: plain C11 scalar code that any C compiler
 * builds, with or without OpenMP). All three give the same bits: every variant is compiled
 * with -ffp-contract=off and fuses a multiply-add only where the code says so (an FMA
 * instruction, or vec16.h's fma32 in scalar code), with the same reduction trees, the same
 * float-to-int rounding and the same exp polynomial. The Python side (localspec.runtime.kernels) tests each
 * variant against the portable one.
 *
 * This header is the ABI: the structs below are mirrored by ctypes Structures
 * (localspec/runtime/kernels/abi.py). Their layouts are pinned by static_asserts here and
 * exported (kernels_layout) so the loader compares them with ctypes' before calling anything;
 * a change to a struct or to a signature below bumps KERNELS_ABI_VERSION.
 */
#ifndef LOCALSPEC_KERNELS_H
#define LOCALSPEC_KERNELS_H

#include <assert.h>
#include <float.h>
#include <stddef.h>
#include <stdint.h>

#define KERNELS_ABI_VERSION 6

#if defined(KERNELS_AVX512) + defined(KERNELS_AVX2) > 1
#error "build one variant: KERNELS_AVX512, KERNELS_AVX2 or neither (portable)"
#endif
#if defined(KERNELS_AVX512)
#define KERNELS_VARIANT "avx512"
#elif defined(KERNELS_AVX2)
#define KERNELS_VARIANT "avx2"
#else
#define KERNELS_VARIANT "portable"
#endif

/* float arithmetic in float: same bits as SIMD lanes (not x87's extended precision) */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the kernels need FLT_EVAL_METHOD == 0 (SSE or NEON float arithmetic)"
#endif

#if defined(__GNUC__)
#define KERNELS_API __attribute__((visibility("default")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define KERNELS_API
#define ALWAYS_INLINE static inline
#endif

/* ---------------------------------------------------------------------- the block layouts
 * Q4_K: w = d * sc_g * q - dmin * mn_g, q in 0..15, one (sc, mn) pair of 6-bit integers per
 * group of GROUP inputs and one (d, dmin) pair per SUPER. Q6_K: w = d * sc_h * (q - 32),
 * q in 0..63, one signed 8-bit scale per half-group of 16 inputs and one d per SUPER.
 * Q5_K: Q4_K with a fifth bit (q in 0..31). Q3_M (no GGUF type: a draft's matrices quantized
 * again, 3.75 bits a weight here against Q4_K's 4.75): Q4_K with q in 0..7 and 8-bit sc, mn.
 * Q8_0: w = d * q, q in -128..127, one d per GROUP.
 * Q4_0: w = d * (q - 8), q in 0..15, one d per GROUP.
 *
 * As a GGUF file stores them (parsed in Python, localspec/runtime/kernels/kquant_formats.py):
 */
enum { BLOCK_ROWS = 16, GROUP = 32, SUPER = 256, GROUPS_PER_SUPER = SUPER / GROUP };

typedef struct {
    uint16_t d, dmin;        /* fp16 */
    uint8_t scales[12];      /* eight 6-bit (sc, mn) pairs */
    uint8_t qs[SUPER / 2];   /* nibbles */
} GgufBlockQ4K;
static_assert(sizeof(GgufBlockQ4K) == 144, "a GGUF Q4_K block is 144 bytes");

typedef struct {
    uint8_t ql[SUPER / 2];   /* low 4 bits */
    uint8_t qh[SUPER / 4];   /* top 2 bits */
    int8_t scales[SUPER / 16];
    uint16_t d;              /* fp16 */
} GgufBlockQ6K;
static_assert(sizeof(GgufBlockQ6K) == 210, "a GGUF Q6_K block is 210 bytes");

typedef struct {
    uint16_t d, dmin;        /* fp16 */
    uint8_t scales[12];      /* as Q4_K's */
    uint8_t qh[SUPER / 8];   /* bit i of byte l: the fifth bit of input 32 i + l */
    uint8_t qs[SUPER / 2];   /* low 4 bits, as Q4_K's nibbles */
} GgufBlockQ5K;
static_assert(sizeof(GgufBlockQ5K) == 176, "a GGUF Q5_K block is 176 bytes");

typedef struct { uint16_t d; int8_t qs[GROUP]; } GgufBlockQ8_0;
static_assert(sizeof(GgufBlockQ8_0) == 34, "a GGUF Q8_0 block is 34 bytes");

typedef struct { uint16_t d; uint8_t qs[GROUP / 2]; } GgufBlockQ4_0;  /* byte j: q[j], q[j+16] */
static_assert(sizeof(GgufBlockQ4_0) == 18, "a GGUF Q4_0 block is 18 bytes");

/* As the kernels read them (made by pack_q4k, pack_q5k, ...): output rows in blocks of
 * BLOCK_ROWS, inputs in groups of GROUP, every array block-major then group-major:
 *   Q4_K qs  [N/16][K/32] Q4KGroup; sc, mn [N/16][K/32][16] u8;
 *        d, dmin [N/16][ceil(K/256)][16] f32 (a width that is not a multiple of 256, such as
 *        896, ends in a partial super-block).
 *   Q6_K qs  as Q4_K's, for the low 4 bits of q; qh [N/16][K/32] Q6KTop;
 *        sc [N/16][K/16][16] i8; d [N/16][K/256][16] f32.
 *   Q5_K qs  [N/16][K/32] Q5KGroup (Q4_K's nibbles and the fifth bits); sc, mn, d, dmin as
 *        Q4_K's.
 *   Q3_M qs  [N/16][K/32] Q3MGroup; sc, mn, d, dmin as Q4_K's.
 *   Q8_0 qs  [N/16][K/32] Q8Group; d [N/16][K/32][16] f32.
 *   Q4_0 qs  [N/16][K/32] Q4KGroup; d [N/16][K/32][16] f32.
 * An operand is 16 rows x 4 inputs (64 bytes, byte 4 r + j for row r, input j): operand o of
 * a group covers its inputs 4 o .. 4 o + 3 (o = 2 i + s: nibble s of Q4KGroup's load i).
 */
typedef struct {
    /* load i (0..3) holds, at byte 4 * r + j, the low nibble q[r][8i + j] and the high nibble
     * q[r][8i + 4 + j] (r: row in the block, j: 0..3): one 64-byte load makes two VNNI
     * operands of 16 rows x 4 inputs */
    uint8_t load[4][64];
} Q4KGroup;
static_assert(sizeof(Q4KGroup) == BLOCK_ROWS * GROUP / 2, "Q4KGroup: 4 bits a weight");

typedef struct {
    /* byte p of vector t (0, 1) holds, at bits 4 * (i % 2) + 2 * s, the top 2 bits of operand
     * s (0: low nibble, 1: high nibble) of load i = 2t + i % 2 at byte p */
    uint8_t vector[2][64];
} Q6KTop;
static_assert(sizeof(Q6KTop) == BLOCK_ROWS * GROUP / 4, "Q6KTop: 2 bits a weight");

typedef struct {
    Q4KGroup low;     /* the low 4 bits */
    uint8_t top[64];  /* byte p holds, at bit o, the fifth bit of operand o at byte p */
} Q5KGroup;
static_assert(sizeof(Q5KGroup) == BLOCK_ROWS * GROUP * 5 / 8, "Q5KGroup: 5 bits a weight");

typedef struct {
    /* byte p of load i (0, 1) holds, at bits 2 s, the low 2 bits of operand 4 i + s at byte p
     * (operand o: 16 rows x inputs 4 o .. 4 o + 3, as Q4KGroup's) */
    uint8_t load[2][64];
    uint8_t top[64];  /* byte p holds, at bit o, the third bit of operand o at byte p */
} Q3MGroup;
static_assert(sizeof(Q3MGroup) == BLOCK_ROWS * GROUP * 3 / 8, "Q3MGroup: 3 bits a weight");

typedef struct {
    /* operand o (0..7): q + 128 as u8, so that VNNI's u8 x s8 products take it */
    uint8_t operand[8][64];
} Q8Group;
static_assert(sizeof(Q8Group) == BLOCK_ROWS * GROUP, "Q8Group: 8 bits a weight");

/* --------------------------------------------------------------------- the decoder stack
 * decoder_forward's arguments: every layer's fused projections (a KPart's kind and its packed
 * tensors in t[], in the order of the product's arguments below: Q4_K qs, sc, mn, d, dmin;
 * Q5_K and Q3_M the same; Q6_K qs, qh, sc, d; Q8_0 and Q4_0 qs, d), the model's shape, and
 * one call's rows. The kinds are ggml's type numbers for the legacy types, the bits for
 * k-quants; Q3_M, which ggml does not have, takes a number outside ggml's range. */
enum { KIND_Q4_0 = 2, KIND_Q4_K = 4, KIND_Q5_K = 5, KIND_Q6_K = 6, KIND_Q8_0 = 8,
       KIND_Q3_M = 103 };
#define MAX_PARTS 4     /* linear layers side by side in one fused projection */
#define MAX_HEAD_DIM 256
#define MAX_SHARED 16   /* query heads per key-value head */

typedef struct { int64_t kind, n; const void *t[5]; const float *bias; } KPart;
typedef struct { int64_t parts; KPart part[MAX_PARTS]; } KFused;  /* parts side by side */
/* q_norm, k_norm [head_dim]: Qwen3's RMSNorm of every query and key head before RoPE; NULL for
 * a model without (Llama, Qwen2). */
typedef struct {
    const float *norm1, *norm2, *q_norm, *k_norm;
    KFused qkv, o, gate_up, down;
} KLayer;
typedef struct {
    const KLayer *layers;
    int64_t n_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;   /* RMSNorm's epsilon, attention's score scale */
} KModel;
typedef struct {
    float *x;                       /* [n, hidden]: embeddings in, last layer's output out */
    int64_t n, start;               /* rows, and the position of the first */
    const float *cos, *sin;         /* [n, head_dim] */
    uint16_t *keys, *values;        /* [layers][kv_heads][capacity][head_dim] bf16 */
    int64_t capacity;
    float *features;                /* [n][count][hidden], NULL when count is 0 */
    const int64_t *feature_layers;  /* [count] */
    int64_t count;
    const int64_t *parents;         /* [n]: the rows form a tree (attend_tree); NULL: a chain */
} KStep;

/* 64-bit targets (what torch ships for), every field at its natural alignment: no padding,
 * so ctypes' mirror is a list of the same fields in the same order. */
static_assert(sizeof(void *) == 8 && sizeof(float) == 4, "the kernels need a 64-bit target");
static_assert(sizeof(KPart) == 64 && offsetof(KPart, t) == 16 && offsetof(KPart, bias) == 56,
              "KPart: kind, n, five tensors, bias");
static_assert(sizeof(KFused) == 8 + MAX_PARTS * 64, "KFused: the count, then the parts");
static_assert(sizeof(KLayer) == 32 + 4 * sizeof(KFused) && offsetof(KLayer, qkv) == 32,
              "KLayer: the four norms, then four projections");
static_assert(sizeof(KModel) == 64 && offsetof(KModel, eps) == 56, "KModel: no padding");
static_assert(sizeof(KStep) == 96 && offsetof(KStep, parents) == 88, "KStep: no padding");

/* ------------------------------------------------------------------------ the exported API
 * Every function returns 0, -1 when scratch memory could not be had, -2 for a shape it does
 * not take. */

/* y [m_rows, n] = x [m_rows, k] times packed Q4_K weights; k % 32 == 0, n % 16 == 0. Row r of
 * y depends on row r of x only: the same bits whatever m_rows or the thread count. */
KERNELS_API int q4k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                           const uint8_t *sc, const uint8_t *mn, const float *d,
                           const float *dmin, int64_t n, float *y, int threads);
/* The same for packed Q6_K weights; k % 256 == 0. */
KERNELS_API int q6k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                           const uint8_t *qh, const int8_t *sc, const float *d, int64_t n,
                           float *y, int threads);
/* The same for packed Q5_K weights (qs: Q5KGroup); k % 32 == 0. */
KERNELS_API int q5k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                           const uint8_t *sc, const uint8_t *mn, const float *d,
                           const float *dmin, int64_t n, float *y, int threads);
/* The same for packed Q3_M weights (qs: Q3MGroup); k % 32 == 0. */
KERNELS_API int q3m_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                           const uint8_t *sc, const uint8_t *mn, const float *d,
                           const float *dmin, int64_t n, float *y, int threads);
/* The same for packed Q8_0 (qs: Q8Group) and Q4_0 (qs: Q4KGroup) weights; k % 32 == 0. */
KERNELS_API int q8_0_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                            const float *d, int64_t n, float *y, int threads);
KERNELS_API int q4_0_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                            const float *d, int64_t n, float *y, int threads);
/* Attention of n new query rows over a bf16 KV cache (see attention.c). */
KERNELS_API int attend_rows(const float *q, const uint16_t *keys, const uint16_t *values,
                            int64_t capacity, int64_t start, int64_t n, int64_t heads,
                            int64_t kv_heads, int64_t d, float scale, float *out, int threads);
/* The same for n new rows that form a tree: parents[j] < j, parents[0] == -1 (attention.c). */
KERNELS_API int attend_tree(const float *q, const uint16_t *keys, const uint16_t *values,
                            int64_t capacity, int64_t start, int64_t n, const int64_t *parents,
                            int64_t heads, int64_t kv_heads, int64_t d, float scale, float *out,
                            int threads);
/* Every layer of ``model`` over the rows of ``step`` (see decoder_stack.c). */
KERNELS_API int decoder_forward(const KModel *model, const KStep *step, int threads);
/* The same over several sequences' steps at once (their x consecutive slices of one buffer):
 * the projections over all rows together, RoPE, cache writes and attention per sequence. */
KERNELS_API int decoder_forward_batch(const KModel *model, const KStep *steps, int64_t count,
                                      int threads);

/* What the loader checks (abi.c): the ABI version, the variant's name, and the layout text
 * "Name=size:field@offset,...;..." of the structs above and the block sizes (written into
 * out, at most size bytes with the NUL; returns the full length, as snprintf). The products
 * take kernels_rows_per_pass() input rows at a time (kquant_matmul.c: a variant's register
 * budget; tests try batches around it). */
KERNELS_API int64_t kernels_abi_version(void);
KERNELS_API const char *kernels_variant(void);
KERNELS_API int64_t kernels_rows_per_pass(void);
KERNELS_API int64_t kernels_layout(char *out, int64_t size);

/* ---------------------------------------------------- shared inside the library, not exported
 * The quantized activations of one call, group-major (xq [K/32][m_rows][32], xs and xsum
 * [K/32][m_rows]): per row and group, int8 inputs, their scale and scale * sum(xq); for Q6_K,
 * Q8_0 and Q4_0 also the int sums of each 16 inputs (xsum16 [K/32][m_rows][2]). */
typedef struct { int8_t *xq; float *xs, *xsum; int32_t *xsum16; } Scratch;

/* Quantize x [m_rows, k] into s (allocated here; with_sums16 for Q6_K, Q8_0 and Q4_0); -1
 * without memory. */
int scratch_make(Scratch *s, const float *x, int64_t m_rows, int64_t k, int with_sums16,
                 int threads);
void scratch_free(Scratch *s);
/* y [m_rows, n] (rows ldy apart) = the quantized rows of s times the packed weights: Q4_K,
 * Q5_K or Q3_M (bits 4, 5 or 3). */
void kquant_run(const Scratch *s, int bits, int64_t m_rows, int64_t k, const uint8_t *qs,
                const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
                int64_t n, float *y, int64_t ldy, int threads);
void q6k_run(const Scratch *s, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *qh,
             const int8_t *sc, const float *d, int64_t n, float *y, int64_t ldy, int threads);
/* Q8_0 (bits 8) or Q4_0 (bits 4). */
void q32_run(const Scratch *s, int bits, int64_t m_rows, int64_t k, const uint8_t *qs,
             const float *d, int64_t n, float *y, int64_t ldy, int threads);

#endif
