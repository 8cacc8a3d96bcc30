/* The attention calls (flashtile.h: forward, backward, their workspace queries): check every
 * argument, pick the exported entry the Python dispatcher would pick (the config for the call's
 * longest key length), lay out the workspace, fill the call struct the generated launchers read,
 * launch. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "runtime.h"


void flashtile_attention_args_init(flashtile_attention_args *args) {
    if (!args)
        return;
    memset(args, 0, sizeof *args);
    args->struct_size = (int)sizeof *args;
    args->dtype = FLASHTILE_BFLOAT16;
    args->window_left = -1;
    args->window_right = -1;
}

/* The exported entry for this call, or an error that says what to export. */
static flashtile_status find_entry(int direction, const flashtile_attention_args *a, int varlen, int64_t max_seqlen_k,
                                   const ft_entry **entry) {
    int direction_seen = 0, dtype_seen = 0, head_dim_seen = 0, layout_seen = 0, options_seen = 0;
    int table_causal;
    const int options = ft_call_options(a->causal, a->window_left, a->window_right, a->softcap, a->alibi_slopes,
                                        &table_causal);
    const int decode = varlen && a->max_seqlen_q <= ft_decode_max_rows;
    for (int i = 0; i < ft_entry_count; i++) {
        const ft_entry *e = &ft_entries[i];
        if (e->direction != direction)
            continue;
        direction_seen = 1;
        if (e->dtype != (int)a->dtype)
            continue;
        dtype_seen = 1;
        if (e->head_dim != a->head_dim)
            continue;
        head_dim_seen = 1;
        if (e->varlen != varlen)
            continue;
        layout_seen = 1;
        if (e->options != options || e->causal != table_causal)
            continue;
        options_seen = 1;
        if ((e->decode < 0 || e->decode == decode) && e->min_seqlen_k <= max_seqlen_k && max_seqlen_k < e->max_seqlen_k) {
            *entry = e;
            return FLASHTILE_SUCCESS;
        }
    }
    const char *how = "export it with `python -m flashtile export --head-dims ... --dtypes ... --features "
                      "forward,backward,varlen --out DIR`";
    const char *what = direction == FT_FORWARD ? "the forward" : "the backward";
    if (!direction_seen)
        return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED, "%s was not exported in this build (see flashtile_build_info()): %s",
                       what, how);
    if (!dtype_seen)
        return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED, "dtype %s was not exported in this build: %s",
                       ft_dtype_name(a->dtype), how);
    if (!head_dim_seen) {
        char list[128];
        ft_head_dim_list(list, sizeof list, ft_head_dims, ft_head_dim_count);
        return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED,
                       "head_dim %d was not exported in this build (it holds head dims %s): %s", a->head_dim, list, how);
    }
    if (!layout_seen)
        return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED,
                       "packed (varlen) batches were not exported in this build (cu_seqlens_q is set): %s "
                       "(features must include varlen)", how);
    char names[96];
    ft_option_names(names, sizeof names, options, table_causal);
    if (!options_seen)
        return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED,
                       "%s attention (window_left / window_right, softcap, alibi_slopes) was not exported in this "
                       "build: export with --features including window, softcap and / or alibi",
                       names);
    return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED, "no exported kernel serves %s %s head dim %d %s with %lld keys", what,
                   ft_dtype_name(a->dtype), a->head_dim, names, (long long)max_seqlen_k);
}

/* Checks everything the host can check and fills the call struct (pointers into the workspace
 * excepted); *lse_bytes etc. tell the workspace layout. */
/* need_grads: 0 for the workspace queries, whose sizes do not depend on the gradients' layouts. */
static flashtile_status prepare(int direction, const flashtile_attention_args *a, const flashtile_attention_grads *g,
                                int need_grads, ft_call *c, const ft_entry **entry) {
    ft_clear_error();
    if (a == NULL)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "args is NULL");
    FT_TRY(ft_check_struct(a->struct_size, (int)sizeof *a, "flashtile_attention_args_init", (int)a->dtype));
    const int varlen = a->cu_seqlens_q != NULL || a->cu_seqlens_k != NULL;
    if (a->batch < 1 || a->seqlen_q < 1 || a->seqlen_k < 1 || a->nheads < 1 || a->nheads_k < 1 || a->head_dim < 1)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "batch %d, seqlen_q %d, seqlen_k %d, nheads %d, nheads_k %d, head_dim %d: each must be at least 1",
                       a->batch, a->seqlen_q, a->seqlen_k, a->nheads, a->nheads_k, a->head_dim);
    FT_TRY(ft_check_heads(a->nheads, a->nheads_k, a->head_dim));
    FT_TRY(ft_check_score_options(a->window_left, a->window_right, a->softcap, a->alibi_slopes, a->alibi_batch_stride,
                                  a->nheads, a->softmax_scale));
    if (varlen) {
        if (a->cu_seqlens_q == NULL || a->cu_seqlens_k == NULL)
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "%s is NULL: packed batches take both cu_seqlens_q and "
                           "cu_seqlens_k", a->cu_seqlens_q == NULL ? "cu_seqlens_q" : "cu_seqlens_k");
        if (!ft_aligned16(a->cu_seqlens_q) || !ft_aligned16(a->cu_seqlens_k))
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "%s is not 16-byte aligned",
                           ft_aligned16(a->cu_seqlens_q) ? "cu_seqlens_k" : "cu_seqlens_q");
        if (a->max_seqlen_q < 1 || a->max_seqlen_q > a->seqlen_q)
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                           "max_seqlen_q %d: expected the longest query sequence, 1 to seqlen_q (%d, the packed total)",
                           a->max_seqlen_q, a->seqlen_q);
        if (a->max_seqlen_k < 1 || a->max_seqlen_k > a->seqlen_k)
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                           "max_seqlen_k %d: expected the longest key sequence, 1 to seqlen_k (%d, the packed total)",
                           a->max_seqlen_k, a->seqlen_k);
    }
    const flashtile_tensor *tensors[4] = {&a->q, &a->k, &a->v, &a->out};
    const char *names[4] = {"q", "k", "v", "out"};
    for (int i = 0; i < 4; i++)
        FT_TRY(ft_check_tensor(names[i], tensors[i], varlen, a->head_dim % 16 == 0));
    if (a->softmax_lse != NULL && !ft_aligned16(a->softmax_lse))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "softmax_lse is not 16-byte aligned");
    if (direction == FT_BACKWARD) {
        if (need_grads && g == NULL)
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "grads is NULL");
        if (a->softmax_lse == NULL)
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                           "softmax_lse is NULL: the backward reads the forward's logsumexp");
    }
    if (direction == FT_BACKWARD && need_grads) {
        const flashtile_tensor *grads[4] = {&g->dout, &g->dq, &g->dk, &g->dv};
        const char *grad_names[4] = {"grads->dout", "grads->dq", "grads->dk", "grads->dv"};
        for (int i = 0; i < 4; i++)
            FT_TRY(ft_check_tensor(grad_names[i], grads[i], varlen, a->head_dim % 16 == 0));
    }

    memset(c, 0, sizeof *c);
    c->batch = varlen ? 1 : a->batch;
    c->n_seqs = a->batch;
    c->rows_q = a->seqlen_q;
    c->rows_k = a->seqlen_k;
    c->max_seqlen_q = varlen ? a->max_seqlen_q : a->seqlen_q;
    c->max_seqlen_k = varlen ? a->max_seqlen_k : a->seqlen_k;
    c->nheads = a->nheads;
    c->nheads_k = a->nheads_k;
    c->head_dim = a->head_dim;
    c->row_stride = (c->rows_q + 3) / 4 * 4;
    c->lse_sb = varlen ? 0 : c->nheads * c->rows_q;
    c->lse_sh = c->rows_q;
    c->softmax_scale = a->softmax_scale > 0.0f ? (double)a->softmax_scale : 1.0 / sqrt((double)a->head_dim);
    c->softcap = a->softcap;
    c->window_left = a->window_left > 0 ? a->window_left : 0;
    c->window_right = a->causal || a->window_right < 0 ? 0 : a->window_right;
    c->alibi = (CUdeviceptr)a->alibi_slopes;
    c->alibi_sb = a->alibi_batch_stride;
    /* A batch of one (and a packed batch, a batch-1 view) has no meaningful batch stride: use the
     * extent of its rows, as the (1, rows, heads, head_dim) view in Python has. */
#define FT_TENSOR(prefix, pointer, t, rows)                                                        \
    do {                                                                                           \
        c->prefix##_sb = c->batch > 1 ? (t).batch_stride : (rows) * (t).row_stride;                \
        c->prefix##_ss = (t).row_stride;                                                           \
        c->prefix##_sh = (t).head_stride;                                                          \
        c->pointer = (CUdeviceptr)(t).data;                                                        \
    } while (0)
    FT_TENSOR(q, q, a->q, c->rows_q);
    FT_TENSOR(k, k, a->k, c->rows_k);
    FT_TENSOR(v, v, a->v, c->rows_k);
    FT_TENSOR(o, o, a->out, c->rows_q);
    c->lse = (CUdeviceptr)a->softmax_lse;
    c->cu_q = (CUdeviceptr)a->cu_seqlens_q;
    c->cu_k = (CUdeviceptr)a->cu_seqlens_k;
    if (direction == FT_BACKWARD && need_grads) {
        FT_TENSOR(do, dout, g->dout, c->rows_q);
        FT_TENSOR(dq, dq, g->dq, c->rows_q);
        FT_TENSOR(dk, dk, g->dk, c->rows_k);
        FT_TENSOR(dv, dv, g->dv, c->rows_k);
    }
#undef FT_TENSOR
    return find_entry(direction, a, varlen, c->max_seqlen_k, entry);
}

/* Workspace layout: [lse if the forward got none] / [delta, lse_log2][dQ accumulator][counts]. */
typedef struct workspace_layout {
    size_t lse, rows, dq_acc, counts, total;
} workspace_layout;

static workspace_layout layout_of(int direction, const flashtile_attention_args *a, const ft_call *c,
                                  const ft_entry *e) {
    workspace_layout w = {0, 0, 0, 0, 0};
    if (direction == FT_FORWARD) {
        w.total = a->softmax_lse ? 0 : ft_align_up((size_t)(c->batch * c->nheads * c->rows_q) * 4);
        return w;
    }
    size_t rows = ft_align_up((size_t)(2 * c->batch * c->nheads * c->row_stride) * 4);
    size_t acc = e->needs_accumulator ? ft_align_up((size_t)(c->batch * c->rows_q * c->nheads * c->head_dim) * 4) : 0;
    w.rows = 0;
    w.dq_acc = rows;
    w.counts = rows + acc;
    w.total = rows + acc + (e->needs_counts ? ft_align_up((size_t)(c->batch * c->nheads_k) * 4) : 0);
    return w;
}

static flashtile_status workspace_size(int direction, const flashtile_attention_args *a, size_t *bytes) {
    ft_call c;
    const ft_entry *e;
    if (bytes == NULL)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "bytes is NULL");
    FT_TRY(prepare(direction, a, NULL, 0, &c, &e));
    *bytes = layout_of(direction, a, &c, e).total;
    return FLASHTILE_SUCCESS;
}

flashtile_status flashtile_attention_forward_workspace_size(const flashtile_attention_args *args, size_t *bytes) {
    return workspace_size(FT_FORWARD, args, bytes);
}

flashtile_status flashtile_attention_backward_workspace_size(const flashtile_attention_args *args, size_t *bytes) {
    return workspace_size(FT_BACKWARD, args, bytes);
}

flashtile_status flashtile_attention_forward(const flashtile_attention_args *args, void *workspace,
                                             size_t workspace_bytes, flashtile_stream_t stream) {
    ft_call c;
    const ft_entry *e;
    FT_TRY(prepare(FT_FORWARD, args, NULL, 1, &c, &e));
    workspace_layout w = layout_of(FT_FORWARD, args, &c, e);
    FT_TRY(ft_check_workspace(workspace, workspace_bytes, w.total));
    if (args->softmax_lse == NULL)
        c.lse = (CUdeviceptr)workspace;
    int sm_count;
    FT_TRY(ft_device(&sm_count));
    c.sm_count = sm_count;
    return e->launch(&c, (CUstream)stream);
}

flashtile_status flashtile_attention_backward(const flashtile_attention_args *args,
                                              const flashtile_attention_grads *grads, void *workspace,
                                              size_t workspace_bytes, flashtile_stream_t stream) {
    ft_call c;
    const ft_entry *e;
    FT_TRY(prepare(FT_BACKWARD, args, grads, 1, &c, &e));
    workspace_layout w = layout_of(FT_BACKWARD, args, &c, e);
    FT_TRY(ft_check_workspace(workspace, workspace_bytes, w.total));
    CUdeviceptr base = (CUdeviceptr)workspace;
    c.delta = base + w.rows;
    c.lse_log2 = base + w.rows + (CUdeviceptr)(c.batch * c.nheads * c.row_stride) * 4;
    c.dq_acc = e->needs_accumulator ? base + w.dq_acc : 0;
    c.counts = e->needs_counts ? base + w.counts : 0;
    int sm_count;
    FT_TRY(ft_device(&sm_count));
    c.sm_count = sm_count;
    return e->launch(&c, (CUstream)stream);
}
