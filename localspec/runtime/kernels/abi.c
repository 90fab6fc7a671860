/* What the loader (localspec/runtime/kernels/library.py) checks before it calls anything: that
 * the library is a build of these sources (kernels_abi_version), of the variant it asked for
 * (kernels_variant), and that the constants and structs it relies on through ctypes are what
 * C has (kernels_layout: sizes and offsets as text, compared with abi.py's mirror). */
#include <stdio.h>
#include <string.h>

#include "kernels.h"

int64_t kernels_abi_version(void) { return KERNELS_ABI_VERSION; }

const char *kernels_variant(void) { return KERNELS_VARIANT; }

/* Text written into out[0..size), always NUL-terminated there; length counts all of it. */
typedef struct { char *out; int64_t size, length; } Text;

static void append(Text *text, const char *format, const char *name, size_t value) {
    char item[128];
    const int n = snprintf(item, sizeof item, format, name, value);
    for (int i = 0; i < n; i++, text->length++)
        if (text->length + 1 < text->size) text->out[text->length] = item[i];
    if (text->size > 0) text->out[text->length < text->size ? text->length : text->size - 1] = 0;
}

/* "NAME=value;" for constants, "Name=size field@offset ...;" for structs (in field order). */
#define CONSTANT(c) append(&text, "%s=%zu;", #c, (size_t)(c))
#define STRUCT(T) append(&text, "%s=%zu", #T, sizeof(T))
#define FIELD(T, f) append(&text, " %s@%zu", #f, offsetof(T, f))
#define END() append(&text, "%s;", "", 0)

int64_t kernels_layout(char *out, int64_t size) {
    Text text = {out, size, 0};
    CONSTANT(BLOCK_ROWS); CONSTANT(GROUP); CONSTANT(SUPER);
    CONSTANT(MAX_PARTS); CONSTANT(MAX_HEAD_DIM); CONSTANT(MAX_SHARED);
    CONSTANT(sizeof(GgufBlockQ4K)); CONSTANT(sizeof(GgufBlockQ6K));
    CONSTANT(sizeof(Q4KGroup)); CONSTANT(sizeof(Q6KTop));
    CONSTANT(sizeof(GgufBlockQ5K)); CONSTANT(sizeof(GgufBlockQ8_0));
    CONSTANT(sizeof(GgufBlockQ4_0));
    CONSTANT(sizeof(Q5KGroup)); CONSTANT(sizeof(Q8Group)); CONSTANT(sizeof(Q3MGroup));
    CONSTANT(KIND_Q4_0); CONSTANT(KIND_Q4_K); CONSTANT(KIND_Q5_K); CONSTANT(KIND_Q6_K);
    CONSTANT(KIND_Q8_0); CONSTANT(KIND_Q3_M);
    STRUCT(KPart); FIELD(KPart, kind); FIELD(KPart, n); FIELD(KPart, t); FIELD(KPart, bias); END();
    STRUCT(KFused); FIELD(KFused, parts); FIELD(KFused, part); END();
    STRUCT(KLayer); FIELD(KLayer, norm1); FIELD(KLayer, norm2); FIELD(KLayer, q_norm);
    FIELD(KLayer, k_norm); FIELD(KLayer, qkv);
    FIELD(KLayer, o); FIELD(KLayer, gate_up); FIELD(KLayer, down); END();
    STRUCT(KModel); FIELD(KModel, layers); FIELD(KModel, n_layers); FIELD(KModel, hidden);
    FIELD(KModel, heads); FIELD(KModel, kv_heads); FIELD(KModel, head_dim);
    FIELD(KModel, intermediate); FIELD(KModel, eps); FIELD(KModel, scale); END();
    STRUCT(KStep); FIELD(KStep, x); FIELD(KStep, n); FIELD(KStep, start); FIELD(KStep, cos);
    FIELD(KStep, sin); FIELD(KStep, keys); FIELD(KStep, values); FIELD(KStep, capacity);
    FIELD(KStep, features); FIELD(KStep, feature_layers); FIELD(KStep, count);
    FIELD(KStep, parents); END();
    return text.length;
}
