/* The argument checks and small helpers the public calls share (attention.c, kvcache.c). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "runtime.h"

flashtile_status ft_check_struct(int struct_size, int expected, const char *init, int dtype) {
    if (struct_size != expected)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "args->struct_size is %d, expected %d: initialise args with %s() (and build against this "
                       "library's flashtile.h)",
                       struct_size, expected, init);
    if (dtype != FLASHTILE_FLOAT16 && dtype != FLASHTILE_BFLOAT16)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "dtype %d: expected FLASHTILE_FLOAT16 or FLASHTILE_BFLOAT16",
                       dtype);
    return FLASHTILE_SUCCESS;
}

flashtile_status ft_check_heads(int nheads, int nheads_k, int head_dim) {
    if (nheads % nheads_k != 0)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "nheads %d is not a multiple of nheads_k %d (GQA / MQA: each key/value head serves a whole "
                       "group of query heads)",
                       nheads, nheads_k);
    if (head_dim > 256)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "head_dim %d: flashtile takes head dims up to 256", head_dim);
    return FLASHTILE_SUCCESS;
}

flashtile_status ft_check_tensor(const char *name, const flashtile_tensor *t, int varlen, int hinted) {
    if (t->data == NULL)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "%s.data is NULL", name);
    if (!ft_aligned16(t->data))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "%s.data = %p is not 16-byte aligned (the kernels load tiles with the TMA copy engine)", name,
                       t->data);
    const int64_t strides[3] = {varlen ? 0 : t->batch_stride, t->row_stride, t->head_stride};
    const char *names[3] = {"batch_stride", "row_stride", "head_stride"};
    for (int i = 0; i < 3; i++) {
        if (strides[i] < 0 || (hinted && strides[i] % 16 != 0))
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                           "%s.%s = %lld: expected a non-negative stride%s (the head dim itself is contiguous)", name,
                           names[i], (long long)strides[i],
                           hinted ? " that is a multiple of 16 elements, as every layout of a head dim that is a "
                                    "multiple of 16 has"
                                  : "");
    }
    return FLASHTILE_SUCCESS;
}

void ft_head_dim_list(char *out, size_t size, const int *list, int n) {
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < n && used < size; i++)
        used += (size_t)snprintf(out + used, size - used, i ? ", %d" : "%d", list[i]);
}

const char *ft_dtype_name(int dtype) { return dtype == FLASHTILE_FLOAT16 ? "fp16" : "bf16"; }

int ft_call_options(int causal, int window_left, int window_right, float softcap, const void *alibi_slopes,
                    int *table_causal) {
    int right = causal ? 0 : window_right;
    int options = (window_left >= 0 ? FT_LEFT : 0) | (right >= 0 ? FT_RIGHT : 0) | (softcap > 0.0f ? FT_SOFTCAP : 0) |
                  (alibi_slopes ? FT_ALIBI : 0);
    *table_causal = window_left < 0 && right == 0;
    return options;
}

void ft_option_names(char *out, size_t size, int options, int causal) {
    snprintf(out, size, "%s%s%s", causal ? "causal" : (options & (FT_LEFT | FT_RIGHT)) ? "sliding-window" : "full",
             options & FT_SOFTCAP ? " softcapped" : "", options & FT_ALIBI ? " ALiBi" : "");
}

flashtile_status ft_check_score_options(int window_left, int window_right, float softcap, const float *alibi_slopes,
                                        int64_t alibi_batch_stride, int nheads, float softmax_scale) {
    if (window_left < -1 || window_right < -1)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "window_left %d, window_right %d: each side is -1 (unbounded) or a number of keys",
                       window_left, window_right);
    if (!(softcap >= 0.0f) || isinf(softcap))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "softcap %g: expected 0 (off) or a positive finite cap",
                       (double)softcap);
    if (alibi_slopes != NULL && !ft_aligned16(alibi_slopes))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "alibi_slopes is not 16-byte aligned");
    if (alibi_slopes != NULL && alibi_batch_stride != 0 && alibi_batch_stride < nheads)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "alibi_batch_stride %lld: 0 for (nheads,) slopes, else at least nheads (%d) for (batch, nheads)",
                       (long long)alibi_batch_stride, nheads);
    if (!(softmax_scale >= 0.0f) || isinf(softmax_scale))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "softmax_scale %g: expected a positive finite scale, or 0 for 1 / sqrt(head_dim)",
                       (double)softmax_scale);
    return FLASHTILE_SUCCESS;
}

size_t ft_align_up(size_t n) { return (n + WORKSPACE_ALIGN - 1) / WORKSPACE_ALIGN * WORKSPACE_ALIGN; }

flashtile_status ft_check_workspace(void *workspace, size_t bytes, size_t needed) {
    if (needed == 0)
        return FLASHTILE_SUCCESS;
    if (workspace == NULL || bytes < needed)
        return ft_fail(FLASHTILE_ERROR_WORKSPACE,
                       "workspace of %zu bytes at %p: this call needs %zu bytes (ask the *_workspace_size function)",
                       bytes, workspace, needed);
    if (((uintptr_t)workspace % WORKSPACE_ALIGN) != 0)
        return ft_fail(FLASHTILE_ERROR_WORKSPACE, "workspace %p is not %d-byte aligned", workspace, WORKSPACE_ALIGN);
    return FLASHTILE_SUCCESS;
}
