/* flashtile: exact attention (FlashAttention) for C and C++ engines, no Python at run time.
 *
 * Written by `python -m flashtile export`, which compiles flashtile's Hopper kernels ahead of time
 * for the head dims, dtypes and features asked for and embeds them in this library. At run time the
 * library needs only the CUDA driver (libcuda.so.1, loaded on first use).
 *
 * Tensors are raw device pointers with explicit strides, counted in elements. q, k, v, out and
 * their gradients are (batch, seqlen, heads, head_dim) with the head dim contiguous; packed
 * (varlen) batches are (total_rows, heads, head_dim) and give cu_seqlens prefix sums. Semantics are
 * flash_attn's: softmax(q k^T * softmax_scale) v per head, GQA / MQA when nheads is a multiple of
 * nheads_k, causal masks aligned to the bottom right (query i of a sequence sees keys up to
 * i + seqlen_k - seqlen_q), softmax_lse in natural-log units.
 *
 * Every call validates its arguments first and returns a status; flashtile_last_error() says what
 * was wrong (thread-local). A call that fails validation touches no memory and launches nothing. The
 * library never allocates device memory: calls that need scratch space take a workspace of at least
 * the size the matching *_workspace_size function reports. Calls are asynchronous on the stream.
 */
#ifndef FLASHTILE_H
#define FLASHTILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FLASHTILE_API_VERSION 1

/* The library is built with hidden symbols; these are its exports. */
#if defined(FLASHTILE_BUILDING) && defined(__GNUC__)
#define FLASHTILE_API __attribute__((visibility("default")))
#else
#define FLASHTILE_API
#endif

/* A CUDA stream: pass a cudaStream_t or CUstream (both are this type), or NULL for the legacy
 * default stream. */
typedef struct CUstream_st *flashtile_stream_t;

typedef enum flashtile_status {
    FLASHTILE_SUCCESS = 0,
    FLASHTILE_ERROR_INVALID_ARGUMENT = 1, /* a null pointer, a bad shape, stride or alignment */
    FLASHTILE_ERROR_NOT_EXPORTED = 2,     /* this head dim / dtype / feature was not exported */
    FLASHTILE_ERROR_UNSUPPORTED = 3,      /* valid, but this build cannot run it (device, option) */
    FLASHTILE_ERROR_WORKSPACE = 4,        /* workspace missing, too small or misaligned */
    FLASHTILE_ERROR_CUDA = 5              /* the CUDA driver failed (or is missing) */
} flashtile_status;

typedef enum flashtile_dtype {
    FLASHTILE_FLOAT16 = 0,
    FLASHTILE_BFLOAT16 = 1
} flashtile_dtype;

/* One (batch, seqlen, heads, head_dim) tensor: strides in elements, the head dim contiguous. For
 * packed batches batch_stride is ignored (rows are counted over the whole packed tensor). */
typedef struct flashtile_tensor {
    void *data;
    int64_t batch_stride;
    int64_t row_stride;
    int64_t head_stride;
} flashtile_tensor;

/* The arguments of one attention call. Fill with flashtile_attention_args_init() first: it sets the
 * defaults (no mask, default scale, dense batch), then set what the call needs. */
typedef struct flashtile_attention_args {
    int struct_size;        /* sizeof(flashtile_attention_args), set by _init */
    flashtile_dtype dtype;  /* of q, k, v, out (and the gradients) */
    int batch;              /* sequences (dense: the batch; packed: the number of sequences) */
    int seqlen_q;           /* dense: query rows per sequence; packed: total query rows */
    int seqlen_k;           /* dense: keys per sequence; packed: total key rows */
    int nheads;             /* query heads */
    int nheads_k;           /* key / value heads; nheads must be a multiple */
    int head_dim;
    flashtile_tensor q, k, v, out;
    /* float32 logsumexp of each query row, written by the forward and read by the backward:
     * (batch, nheads, seqlen_q) contiguous, or (nheads, total_q) contiguous for packed batches.
     * May be NULL in a forward that does not need it (the workspace then holds it). */
    float *softmax_lse;
    float softmax_scale;    /* 0: 1 / sqrt(head_dim) */
    int causal;             /* nonzero: bottom-right aligned causal mask */
    int window_left;        /* sliding window, -1: unbounded (flash_attn's window_size) */
    int window_right;
    float softcap;          /* 0: off */
    const float *alibi_slopes; /* NULL: off; else (nheads,) or (batch, nheads) float32 */
    int64_t alibi_batch_stride; /* 0 for (nheads,) slopes */
    /* Packed (varlen) batches: int32 prefix sums of the sequences' lengths (batch + 1 values, first
     * 0, last the totals) and the longest sequence of each. NULL cu_seqlens_q: a dense batch. */
    const int32_t *cu_seqlens_q;
    const int32_t *cu_seqlens_k;
    int max_seqlen_q;
    int max_seqlen_k;
} flashtile_attention_args;

/* The backward's tensors: dout (the gradient of out) and the gradients written, laid out like q,
 * k, v (dq like q, dk / dv like k / v). */
typedef struct flashtile_attention_grads {
    flashtile_tensor dout, dq, dk, dv;
} flashtile_attention_grads;

/* Defaults: no mask, default scale, dense batch; struct_size set. */
FLASHTILE_API void flashtile_attention_args_init(flashtile_attention_args *args);

/* out (and softmax_lse) <- attention(q, k, v). */
FLASHTILE_API flashtile_status flashtile_attention_forward_workspace_size(const flashtile_attention_args *args, size_t *bytes);
FLASHTILE_API flashtile_status flashtile_attention_forward(const flashtile_attention_args *args, void *workspace,
                                             size_t workspace_bytes, flashtile_stream_t stream);

/* dq, dk, dv <- gradients, from the forward's q, k, v, out and softmax_lse and dout. */
FLASHTILE_API flashtile_status flashtile_attention_backward_workspace_size(const flashtile_attention_args *args,
                                                             size_t *bytes);
FLASHTILE_API flashtile_status flashtile_attention_backward(const flashtile_attention_args *args,
                                              const flashtile_attention_grads *grads, void *workspace,
                                              size_t workspace_bytes, flashtile_stream_t stream);

/* The kv-cache call (flash_attn_with_kvcache): the new tokens of each sequence, if any, are written
 * into a paged cache in place at positions cache_seqlens[b] ..., then the queries attend to keys
 * 0 .. cache_seqlens[b] + seqlen_new - 1 of their sequence (causal and windows aligned to that end).
 * Export with --features kvcache (and --page-sizes). A contiguous cache (batch, capacity, nheads_k,
 * head_dim) is a paged one: pages of page_size rows (capacity a multiple of it, batch_stride ==
 * capacity * row_stride) with block_table[b][j] = b * (capacity / page_size) + j. */
typedef struct flashtile_kvcache_args {
    int struct_size;        /* sizeof(flashtile_kvcache_args), set by _init */
    flashtile_dtype dtype;  /* of q, out, the caches and the new tokens */
    int batch;              /* sequences */
    int seqlen_q;           /* query rows per sequence (1 when decoding) */
    int nheads, nheads_k, head_dim;
    flashtile_tensor q, out; /* (batch, seqlen_q, nheads, head_dim) */
    /* The caches, (num_pages, page_size, nheads_k, head_dim) each; batch_stride is the page stride. */
    flashtile_tensor k_cache, v_cache;
    int num_pages;
    int page_size;          /* rows per page: one of the exported page sizes */
    /* int32 (batch, max_pages_per_seq) device array: the pages of each sequence, in order; rows
     * block_table_stride apart (0: max_pages_per_seq). Page numbers outside 0 .. num_pages - 1 are
     * clamped (a wrong answer, never an access outside the cache). */
    const int32_t *block_table;
    int max_pages_per_seq;
    int64_t block_table_stride;
    /* int32 (batch,) device array: tokens already in each sequence's cache. New tokens that would
     * land past max_pages_per_seq * page_size are dropped, and attention reads no further. */
    const int32_t *cache_seqlens;
    /* Optional new tokens, (batch, seqlen_new, nheads_k, head_dim) each; k_new.data NULL: none. */
    flashtile_tensor k_new, v_new;
    int seqlen_new;
    float *softmax_lse;     /* (batch, nheads, seqlen_q) float32 contiguous, or NULL */
    float softmax_scale;    /* 0: 1 / sqrt(head_dim) */
    int causal;
    int window_left, window_right; /* -1: unbounded */
    float softcap;
    const float *alibi_slopes; /* NULL, (nheads,) or (batch, nheads) float32 */
    int64_t alibi_batch_stride;
    /* Programs that share each sequence's keys (split-KV), merged by their logsumexp: 0 picks from
     * the shape and the device's multiprocessors (as the Python API does), 1 turns splitting off. */
    int num_splits;
} flashtile_kvcache_args;

/* Defaults: no new tokens, no mask, default scale, automatic splits; struct_size set. */
FLASHTILE_API void flashtile_kvcache_args_init(flashtile_kvcache_args *args);

/* The workspace the call takes (with num_splits 0 it depends on the current device). */
FLASHTILE_API flashtile_status flashtile_kvcache_forward_workspace_size(const flashtile_kvcache_args *args,
                                                                        size_t *bytes);
/* k_cache, v_cache <- the new tokens appended; out (and softmax_lse) <- attention over the cache. */
FLASHTILE_API flashtile_status flashtile_kvcache_forward(const flashtile_kvcache_args *args, void *workspace,
                                                         size_t workspace_bytes, flashtile_stream_t stream);

/* A short name of a status ("invalid argument", ...). */
FLASHTILE_API const char *flashtile_status_string(flashtile_status status);

/* What went wrong in this thread's last failed call, naming the argument and what was expected;
 * "" after a successful one. */
FLASHTILE_API const char *flashtile_last_error(void);

/* What this build holds: flashtile and Triton versions, architecture, head dims, dtypes, features,
 * and the export command that made it. */
FLASHTILE_API const char *flashtile_build_info(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHTILE_H */
