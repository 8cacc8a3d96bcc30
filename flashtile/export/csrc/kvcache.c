/* The kv-cache call (flashtile.h: flashtile_kvcache_forward): check every argument, append the new
 * tokens (the update kernel), then attend over the paged cache with the portable forward, split-KV
 * when few programs would read a long cache, as flashtile/dispatch.py's kvcache_attention does:
 * the same split count and GQA heads as rows for one query. Unlike Python, contiguous caches are
 * read as one page per sequence, 2-64 query rows do not pack a GQA group's heads, and a group of 17-64
 * heads as rows takes the 128-row tile, not Python's 64-row one (slower, same results within rounding). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "runtime.h"

void flashtile_kvcache_args_init(flashtile_kvcache_args *args) {
    if (!args)
        return;
    memset(args, 0, sizeof *args);
    args->struct_size = (int)sizeof *args;
    args->dtype = FLASHTILE_BFLOAT16;
    args->window_left = -1;
    args->window_right = -1;
}

/* dispatch._auto_splits: the fewest splits within 5% of the best modelled use of the GPU (one
 * program per multiprocessor at a time, in waves), each split a whole number of 128-key steps of at
 * least 256 keys, at most 128 splits. */
static int auto_splits(int64_t batch, int64_t nheads, int64_t rows, int64_t capacity, int sm_count) {
    const int64_t programs = MAX(1, batch * nheads * CDIV(rows, rows <= ft_decode_max_rows ? 16 : 128));
    const int64_t sms = sm_count;
    double fill[129] = {0.0}, best;
    fill[1] = (double)programs / (double)(sms * CDIV(programs, sms));
    best = fill[1];
    for (int64_t keys = 256; keys < capacity; keys += 128) {
        const int64_t s = CDIV(capacity, keys), grid = programs * s;
        if (s > 128)
            continue;
        fill[s] = (double)grid / (double)(sms * CDIV(grid, sms));
        if (fill[s] > best)
            best = fill[s];
    }
    for (int s = 1; s <= 128; s++)
        if (fill[s] > 0.0 && fill[s] >= 0.95 * best)
            return s;
    return 1;
}

static flashtile_status find_update(const flashtile_kvcache_args *a, const ft_entry **entry) {
    for (int i = 0; i < ft_entry_count; i++) {
        const ft_entry *e = &ft_entries[i];
        if (e->direction == FT_KVCACHE_UPDATE && e->dtype == (int)a->dtype && e->head_dim == a->head_dim) {
            *entry = e;
            return FLASHTILE_SUCCESS;
        }
    }
    return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED,
                   "the kv-cache call for %s head dim %d was not exported in this build: export with --features "
                   "including kvcache and --head-dims / --dtypes including it",
                   ft_dtype_name(a->dtype), a->head_dim);
}

/* The forward entry for these options, query rows (decode: at most ft_decode_max_rows) and split. */
static flashtile_status find_forward(const flashtile_kvcache_args *a, int options, int table_causal, int decode,
                                     int split, const ft_entry **entry) {
    int call_seen = 0, options_seen = 0;
    for (int i = 0; i < ft_entry_count; i++) {
        const ft_entry *e = &ft_entries[i];
        if (e->direction != FT_KVCACHE || e->dtype != (int)a->dtype || e->head_dim != a->head_dim)
            continue;
        call_seen = 1;
        if (e->options != options || e->causal != table_causal)
            continue;
        options_seen = 1;
        if (e->page_size == a->page_size && e->decode == decode && e->split == split) {
            *entry = e;
            return FLASHTILE_SUCCESS;
        }
    }
    if (!call_seen)
        return find_update(a, entry); /* the same message: nothing of the kv-cache call for this dtype / head dim */
    char names[96];
    ft_option_names(names, sizeof names, options, table_causal);
    if (!options_seen)
        return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED,
                       "the kv-cache call with %s attention (window_left / window_right, softcap, alibi_slopes) was "
                       "not exported in this build: export with --features including window, softcap and / or alibi",
                       names);
    return ft_fail(FLASHTILE_ERROR_NOT_EXPORTED,
                   "page_size %d was not exported in this build (see flashtile_build_info()): export with "
                   "--features kvcache --page-sizes including %d",
                   a->page_size, a->page_size);
}

/* What one call runs: the update (or none), the forward, the call struct of each, the workspace. */
typedef struct kvcache_plan {
    const ft_entry *update, *forward;
    ft_call update_call, call;
    size_t seqused, lse, o_part, lse_part, total; /* workspace offsets and size */
} kvcache_plan;

static flashtile_status check_args(const flashtile_kvcache_args *a) {
    if (a == NULL)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "args is NULL");
    FT_TRY(ft_check_struct(a->struct_size, (int)sizeof *a, "flashtile_kvcache_args_init", (int)a->dtype));
    if (a->batch < 1 || a->seqlen_q < 1 || a->nheads < 1 || a->nheads_k < 1 || a->head_dim < 1)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "batch %d, seqlen_q %d, nheads %d, nheads_k %d, head_dim %d: each must be at least 1", a->batch,
                       a->seqlen_q, a->nheads, a->nheads_k, a->head_dim);
    FT_TRY(ft_check_heads(a->nheads, a->nheads_k, a->head_dim));
    FT_TRY(ft_check_score_options(a->window_left, a->window_right, a->softcap, a->alibi_slopes, a->alibi_batch_stride,
                                  a->nheads, a->softmax_scale));
    if (a->num_pages < 1 || a->page_size < 1 || a->max_pages_per_seq < 1)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "num_pages %d, page_size %d, max_pages_per_seq %d: each must be at least 1", a->num_pages,
                       a->page_size, a->max_pages_per_seq);
    if (a->block_table == NULL || !ft_aligned16(a->block_table))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "block_table %s: expected the int32 (batch, max_pages_per_seq) page numbers, 16-byte aligned",
                       a->block_table == NULL ? "is NULL" : "is not 16-byte aligned");
    if (a->block_table_stride != 0 && a->block_table_stride < a->max_pages_per_seq)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "block_table_stride %lld: 0 (rows of max_pages_per_seq) or at least max_pages_per_seq (%d)",
                       (long long)a->block_table_stride, a->max_pages_per_seq);
    if (a->cache_seqlens == NULL || !ft_aligned16(a->cache_seqlens))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "cache_seqlens %s: expected the int32 (batch,) tokens already in each cache, 16-byte aligned",
                       a->cache_seqlens == NULL ? "is NULL" : "is not 16-byte aligned");
    const int hinted = a->head_dim % 16 == 0;
    FT_TRY(ft_check_tensor("q", &a->q, 0, hinted));
    FT_TRY(ft_check_tensor("out", &a->out, 0, hinted));
    FT_TRY(ft_check_tensor("k_cache", &a->k_cache, 0, hinted));
    FT_TRY(ft_check_tensor("v_cache", &a->v_cache, 0, hinted));
    const int has_new = a->k_new.data != NULL || a->v_new.data != NULL;
    if (has_new) {
        FT_TRY(ft_check_tensor("k_new", &a->k_new, 0, hinted));
        FT_TRY(ft_check_tensor("v_new", &a->v_new, 0, hinted));
        const int64_t capacity = (int64_t)a->max_pages_per_seq * a->page_size;
        if (a->seqlen_new < 1 || a->seqlen_new > capacity)
            return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                           "seqlen_new %d: expected 1 to the capacity of a sequence's cache, max_pages_per_seq * "
                           "page_size = %lld",
                           a->seqlen_new, (long long)capacity);
    } else if (a->seqlen_new != 0) {
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "seqlen_new is %d but k_new.data and v_new.data are NULL",
                       a->seqlen_new);
    }
    if (a->softmax_lse != NULL && !ft_aligned16(a->softmax_lse))
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "softmax_lse is not 16-byte aligned");
    if (a->num_splits < 0)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "num_splits %d: expected 0 (automatic), 1 (off) or more",
                       a->num_splits);
    return FLASHTILE_SUCCESS;
}

/* Checks the call and works out its plan; sm_count < 0: the automatic split count needs the device,
 * which is asked for (the workspace query and the call alike). */
static flashtile_status prepare(const flashtile_kvcache_args *a, kvcache_plan *p) {
    ft_clear_error();
    FT_TRY(check_args(a));
    memset(p, 0, sizeof *p);
    const int64_t group = a->nheads / a->nheads_k;
    const int64_t capacity = (int64_t)a->max_pages_per_seq * a->page_size;

    /* The call as the update sees it: the tensors as given. */
    ft_call *c = &p->update_call;
    c->batch = c->n_seqs = a->batch;
    c->rows_q = c->max_seqlen_q = a->seqlen_q;
    c->nheads = a->nheads;
    c->nheads_k = a->nheads_k;
    c->head_dim = a->head_dim;
    c->seqlen_new = a->seqlen_new;
    c->page_size = a->page_size;
    c->num_pages = a->num_pages;
    c->seq_pages = a->max_pages_per_seq;
    c->bt_sb = a->block_table_stride ? a->block_table_stride : a->max_pages_per_seq;
    c->rows_k = c->max_seqlen_k = capacity;
    c->lse_sb = (int64_t)a->nheads * a->seqlen_q;
    c->lse_sh = a->seqlen_q;
    c->softmax_scale = a->softmax_scale > 0.0f ? (double)a->softmax_scale : 1.0 / sqrt((double)a->head_dim);
    c->softcap = a->softcap;
    c->window_left = a->window_left > 0 ? a->window_left : 0;
    c->window_right = a->causal || a->window_right < 0 ? 0 : a->window_right;
    c->alibi = (CUdeviceptr)a->alibi_slopes;
    c->alibi_sb = a->alibi_batch_stride;
#define FT_STRIDES(prefix, t) (c->prefix##_sb = (t).batch_stride, c->prefix##_ss = (t).row_stride, \
                               c->prefix##_sh = (t).head_stride)
    FT_STRIDES(q, a->q);
    FT_STRIDES(o, a->out);
    FT_STRIDES(k, a->k_cache);
    FT_STRIDES(v, a->v_cache);
    FT_STRIDES(kn, a->k_new);
    FT_STRIDES(vn, a->v_new);
#undef FT_STRIDES
    c->q = (CUdeviceptr)a->q.data;
    c->o = (CUdeviceptr)a->out.data;
    c->k = (CUdeviceptr)a->k_cache.data;
    c->v = (CUdeviceptr)a->v_cache.data;
    c->knew = (CUdeviceptr)a->k_new.data;
    c->vnew = (CUdeviceptr)a->v_new.data;
    c->lse = (CUdeviceptr)a->softmax_lse;
    c->cache_seqlens = (CUdeviceptr)a->cache_seqlens;
    c->block_table = (CUdeviceptr)a->block_table;
    if (a->seqlen_new > 0)
        FT_TRY(find_update(a, &p->update));

    /* The forward's view: one query per sequence with GQA runs the group's query heads as the rows
     * of their kv head, which is read once for all of them (no mask between the rows: one query
     * sees every key, causal or not). Row g of kv head h is query head h * group + g. */
    p->call = *c;
    ft_call *f = &p->call;
    const int heads_as_rows = a->seqlen_q == 1 && group > 1 && a->window_left < 0 && a->window_right < 0 &&
                              a->alibi_slopes == NULL;
    int table_causal, options;
    if (heads_as_rows) {
        f->rows_q = f->max_seqlen_q = group;
        f->nheads = a->nheads_k;
        f->q_ss = a->q.head_stride;
        f->q_sh = a->q.head_stride * group;
        f->o_ss = a->out.head_stride;
        f->o_sh = a->out.head_stride * group;
        f->lse_sb = a->nheads;
        f->lse_sh = group;
        f->window_right = 0;
        options = ft_call_options(0, -1, -1, a->softcap, NULL, &table_causal);
    } else {
        options = ft_call_options(a->causal, a->window_left, a->window_right, a->softcap, a->alibi_slopes,
                                  &table_causal);
    }
    const int decode = f->rows_q <= ft_decode_max_rows;

    int splits = a->num_splits;
    if (splits == 0) {
        int sm_count;
        FT_TRY(ft_device(&sm_count));
        splits = auto_splits(f->batch, f->nheads, f->rows_q, capacity, sm_count);
    }
    f->n_splits = 1;
    if (splits > 1) { /* SplitForward: keys per split rounded up to the tile; no split left without keys */
        FT_TRY(find_forward(a, options, table_causal, decode, 1, &p->forward));
        const int64_t block_n = p->forward->block_n;
        f->keys_per_split = CDIV(CDIV(MAX(capacity, 1), splits), block_n) * block_n;
        f->n_splits = CDIV(MAX(capacity, 1), f->keys_per_split);
    }
    if (f->n_splits <= 1) {
        f->n_splits = 1;
        f->keys_per_split = 0;
        FT_TRY(find_forward(a, options, table_causal, decode, 0, &p->forward));
    }

    /* Workspace: [seqused][lse when not given][partial outputs][partial lse]. */
    p->seqused = 0;
    p->lse = ft_align_up((size_t)a->batch * 4);
    p->o_part = p->lse + (a->softmax_lse ? 0 : ft_align_up((size_t)a->batch * a->nheads * a->seqlen_q * 4));
    const size_t rows = (size_t)(f->batch * f->rows_q * f->nheads);
    p->lse_part = p->o_part + (f->n_splits > 1 ? ft_align_up((size_t)f->n_splits * rows * a->head_dim * 4) : 0);
    p->total = p->lse_part + (f->n_splits > 1 ? ft_align_up((size_t)f->n_splits * rows * 4) : 0);
    return FLASHTILE_SUCCESS;
}

flashtile_status flashtile_kvcache_forward_workspace_size(const flashtile_kvcache_args *args, size_t *bytes) {
    kvcache_plan p;
    if (bytes == NULL)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "bytes is NULL");
    FT_TRY(prepare(args, &p));
    *bytes = p.total;
    return FLASHTILE_SUCCESS;
}

flashtile_status flashtile_kvcache_forward(const flashtile_kvcache_args *args, void *workspace, size_t workspace_bytes,
                                           flashtile_stream_t stream) {
    kvcache_plan p;
    FT_TRY(prepare(args, &p));
    FT_TRY(ft_check_workspace(workspace, workspace_bytes, p.total));
    int sm_count;
    FT_TRY(ft_device(&sm_count));
    const CUdeviceptr base = (CUdeviceptr)workspace;
    /* Without new tokens the cache holds cache_seqlens keys: the forward reads them directly. */
    const CUdeviceptr seqused = p.update ? base + p.seqused : (CUdeviceptr)args->cache_seqlens;
    const CUdeviceptr lse = args->softmax_lse ? (CUdeviceptr)args->softmax_lse : base + p.lse;
    p.update_call.seqused = p.call.seqused = seqused;
    p.update_call.lse = p.call.lse = lse;
    p.call.o_part = base + p.o_part;
    p.call.lse_part = base + p.lse_part;
    p.update_call.sm_count = p.call.sm_count = sm_count;
    if (p.update)
        FT_TRY(p.update->launch(&p.update_call, (CUstream)stream));
    return p.forward->launch(&p.call, (CUstream)stream);
}
