/* The C library's internals, shared by the generated kernel table (flashtile_kernels.c, written by
 * `python -m flashtile export`) and the hand-written parts (runtime.c: the CUDA driver, modules,
 * TMA descriptors and launches; attention.c: the public calls). Not installed. */
#ifndef FLASHTILE_RUNTIME_H
#define FLASHTILE_RUNTIME_H

#include <cuda.h>
#include <stdint.h>

#include "flashtile.h"

/* Everything a kernel argument is computed from (flashtile/export/bindings.py names these fields
 * and checks its expressions against the Python host plans). Integers are int64. */
typedef struct ft_call {
    int64_t batch, n_seqs, rows_q, rows_k, max_seqlen_q, max_seqlen_k, nheads, nheads_k, head_dim;
    int64_t sm_count, row_stride, lse_sb, lse_sh;
    int64_t window_left, window_right, alibi_sb; /* window sides at least 0; ALiBi slopes' batch stride */
    int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
    int64_t do_sb, do_ss, do_sh, dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh;
    /* The kv-cache call: k / v are the paged caches (k_sb the page stride), kn / vn the new tokens. */
    int64_t seqlen_new, page_size, num_pages, seq_pages, bt_sb, n_splits, keys_per_split;
    int64_t kn_sb, kn_ss, kn_sh, vn_sb, vn_ss, vn_sh;
    double softmax_scale, softcap;
    CUdeviceptr q, k, v, o, lse, dout, dq, dk, dv, cu_q, cu_k, delta, lse_log2, dq_acc, counts, alibi;
    CUdeviceptr knew, vnew, cache_seqlens, seqused, block_table, o_part, lse_part;
} ft_call;

/* One embedded kernel. */
typedef struct ft_kernel {
    const char *name;
    const unsigned char *cubin;
    size_t cubin_size;
    int shared_bytes;
    int threads;
} ft_kernel;

/* Entry directions: the attention calls, the kv-cache call's forward and its cache update. */
enum { FT_FORWARD = 0, FT_BACKWARD = 1, FT_KVCACHE = 2, FT_KVCACHE_UPDATE = 3 };
/* Score options (bits of ft_entry.options; entries.OPTIONS in Python). Causal is the right side of
 * the window at 0. */
enum { FT_LEFT = 1, FT_RIGHT = 2, FT_SOFTCAP = 4, FT_ALIBI = 8 };

/* One entry: the kernels of one (direction, dtype, head dim, options, layout) for key lengths in
 * [min_seqlen_k, max_seqlen_k), launched in order by launch(). causal: the config tables' causal
 * (no left side, the right side at 0). decode: packed portable forwards, 1 for calls of at most
 * ft_decode_max_rows query rows per sequence, 0 above; -1 for any. */
typedef struct ft_entry {
    int direction;
    int dtype;
    int head_dim;
    int causal;
    int varlen;
    int options;
    int decode;
    int64_t min_seqlen_k;
    int64_t max_seqlen_k;
    int needs_counts;       /* the int32 (batch, nheads_k) counts in the workspace */
    int needs_accumulator;  /* the float32 dQ accumulator in the workspace (the Hopper backward) */
    int page_size;          /* kv-cache forwards: the cache's page size */
    int split;              /* kv-cache forwards: split-KV (partial results in the workspace, then merged) */
    int block_n;            /* kv-cache forwards: keys per tile (each split's keys are a multiple) */
    flashtile_status (*launch)(const ft_call *call, CUstream stream);
    const char *name;
} ft_entry;

extern ft_kernel ft_kernels[];
extern const int ft_kernel_count;
extern const ft_entry ft_entries[];
extern const int ft_entry_count;
extern const char ft_build_info[];
extern const int ft_head_dims[];
extern const int ft_head_dim_count;
extern const int ft_decode_max_rows;

/* The binding expressions' functions (non-negative operands). */
static inline int64_t CDIV(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t DIV(int64_t a, int64_t b) { return a / b; }
static inline int64_t MIN(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t MAX(int64_t a, int64_t b) { return a > b ? a : b; }
#define SEL(c, a, b) ((c) ? (a) : (b))

#define FT_TRY(expr)                                   \
    do {                                               \
        flashtile_status ft_status_ = (expr);          \
        if (ft_status_ != FLASHTILE_SUCCESS)           \
            return ft_status_;                         \
    } while (0)

/* Argument checks and helpers the public calls share (checks.c). */
#define WORKSPACE_ALIGN 256
static inline int ft_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }
/* The args struct's size (set by init, the function named) and its dtype. */
flashtile_status ft_check_struct(int struct_size, int expected, const char *init, int dtype);
/* nheads a multiple of nheads_k, head_dim at most 256 (all of them already checked >= 1). */
flashtile_status ft_check_heads(int nheads, int nheads_k, int head_dim);
/* A (batch, seqlen, heads, head_dim) tensor: data set and 16-byte aligned, strides non-negative and,
 * when hinted (head dims that are multiples of 16: the kernels were compiled for it), multiples of
 * 16; the batch stride is not checked for packed batches (varlen). */
flashtile_status ft_check_tensor(const char *name, const flashtile_tensor *t, int varlen, int hinted);
flashtile_status ft_check_score_options(int window_left, int window_right, float softcap, const float *alibi_slopes,
                                        int64_t alibi_batch_stride, int nheads, float softmax_scale);
/* The score options of a call (FT_LEFT, ...) and whether the config tables see it as causal. */
int ft_call_options(int causal, int window_left, int window_right, float softcap, const void *alibi_slopes,
                    int *table_causal);
void ft_option_names(char *out, size_t size, int options, int causal);
void ft_head_dim_list(char *out, size_t size, const int *list, int n);
const char *ft_dtype_name(int dtype);
size_t ft_align_up(size_t n);
flashtile_status ft_check_workspace(void *workspace, size_t bytes, size_t needed);

/* Records this thread's error message (printf-style) and returns status. */
flashtile_status ft_fail(flashtile_status status, const char *format, ...);
void ft_clear_error(void);

/* An int64 value as an int32 kernel argument, or an error naming it. */
flashtile_status ft_i32(int64_t value, int32_t *out, const char *what);

/* The driver (loaded on first use), the current context's device facts. */
flashtile_status ft_device(int *sm_count);

/* A tiled TMA descriptor: rank dims outer first (as the kernels' bindings list them), strides in
 * elements (the last is 1), box outer first, swizzle and element type from the compiled kernel. */
flashtile_status ft_encode(CUtensorMap *map, CUdeviceptr base, int data_type, int elem_bytes, int swizzle, int rank,
                           const int64_t *shape, const int64_t *strides, const uint32_t *box, const char *what);

/* Launch kernel ft_kernels[index] (its module loaded into the current context on first use). */
flashtile_status ft_launch(int index, const int64_t grid[3], int pdl, CUstream stream, void **params);

#endif
