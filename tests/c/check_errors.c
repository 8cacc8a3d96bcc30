/* check_errors: host-only test of flashtile's argument validation and error messages.
 *
 * Needs no GPU and no CUDA driver: every call here either fails validation (which the header
 * promises happens before anything touches memory or loads the driver) or, for the one valid call,
 * is expected to report the missing driver. Device pointers are fake but aligned addresses that the
 * library must never dereference on the host. Built against an export that holds head dim 64 in bf16,
 * the kv-cache call with page size 256 (--features ...,kvcache), and no head dim 40, no window.
 *
 * Prints "ok <case>" or "FAIL <case>: ..." per case and "check_errors: N passed, M failed" last;
 * exits 0 only when every case passes.
 */
#include "flashtile.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int n_passed, n_failed;

/* Fake device addresses: nonzero, 1 MiB apart, aligned far beyond any vector access. */
#define FAKE(n) ((void *)(uintptr_t)(0x100000u * (n)))
#define FAKE_WORKSPACE FAKE(0x100)
#define BIG_WORKSPACE ((size_t)1 << 30) /* ample, so workspace size is never why a case fails */

enum { B = 2, S = 128, H = 8, HK = 8, D = 64 };

static flashtile_tensor tensor(int n, int heads) {
    flashtile_tensor t;
    t.data = FAKE(n);
    t.row_stride = (int64_t)heads * D;
    t.batch_stride = (int64_t)S * t.row_stride;
    t.head_stride = D;
    return t;
}

/* The valid baseline: bf16, batch 2, seqlen 128, 8 heads, head dim 64, contiguous. */
static flashtile_attention_args baseline(void) {
    flashtile_attention_args a;
    flashtile_attention_args_init(&a);
    a.dtype = FLASHTILE_BFLOAT16;
    a.batch = B;
    a.seqlen_q = S;
    a.seqlen_k = S;
    a.nheads = H;
    a.nheads_k = HK;
    a.head_dim = D;
    a.q = tensor(1, H);
    a.k = tensor(2, HK);
    a.v = tensor(3, HK);
    a.out = tensor(4, H);
    a.softmax_lse = (float *)FAKE(5);
    return a;
}

/* The baseline as a packed batch: 2 sequences of 128 rows, (total, heads, head_dim) tensors. */
static flashtile_attention_args packed(void) {
    flashtile_attention_args a = baseline();
    a.seqlen_q = a.seqlen_k = B * S;
    a.q.batch_stride = a.k.batch_stride = a.v.batch_stride = a.out.batch_stride = 0;
    a.cu_seqlens_q = (const int32_t *)FAKE(6);
    a.cu_seqlens_k = (const int32_t *)FAKE(7);
    a.max_seqlen_q = a.max_seqlen_k = S;
    return a;
}

static flashtile_attention_grads valid_grads(void) {
    flashtile_attention_grads g;
    g.dout = tensor(8, H);
    g.dq = tensor(9, H);
    g.dk = tensor(10, HK);
    g.dv = tensor(11, HK);
    return g;
}

enum { PAGE = 256, PAGES = 64, SEQ_PAGES = 4, NEW = 3 };

/* A valid kv-cache call: 2 sequences of one query each against a paged cache (64 pages of 256 rows,
 * 4 pages per sequence), appending 3 tokens, GQA 8 / 2 heads, without splits (no device asked). */
static flashtile_kvcache_args kv_baseline(void) {
    flashtile_kvcache_args a;
    flashtile_kvcache_args_init(&a);
    a.batch = B;
    a.seqlen_q = 1;
    a.nheads = H;
    a.nheads_k = 2;
    a.head_dim = D;
    a.q = tensor(1, H);
    a.out = tensor(4, H);
    a.k_cache = tensor(2, 2);
    a.v_cache = tensor(3, 2);
    a.k_cache.batch_stride = a.v_cache.batch_stride = (int64_t)PAGE * 2 * D;
    a.num_pages = PAGES;
    a.page_size = PAGE;
    a.block_table = (const int32_t *)FAKE(12);
    a.max_pages_per_seq = SEQ_PAGES;
    a.cache_seqlens = (const int32_t *)FAKE(13);
    a.k_new = tensor(14, 2);
    a.v_new = tensor(15, 2);
    a.seqlen_new = NEW;
    a.num_splits = 1;
    return a;
}

static flashtile_status kv_forward(const flashtile_kvcache_args *a) {
    return flashtile_kvcache_forward(a, FAKE_WORKSPACE, BIG_WORKSPACE, NULL);
}

static flashtile_status forward(const flashtile_attention_args *a) {
    return flashtile_attention_forward(a, FAKE_WORKSPACE, BIG_WORKSPACE, NULL);
}

static flashtile_status backward(const flashtile_attention_args *a, const flashtile_attention_grads *g) {
    return flashtile_attention_backward(a, g, FAKE_WORKSPACE, BIG_WORKSPACE, NULL);
}

static int is_ident(char c) { return isalnum((unsigned char)c) || c == '_'; }

/* One term of an expectation. "=name": name as a whole identifier (so "q" does not match "dq" or
 * "seq"), case-sensitive. Otherwise: a case-insensitive substring ("align" matches "aligned"). */
static int has_term(const char *msg, const char *term, size_t len) {
    size_t i, j, n = strlen(msg);
    int word = term[0] == '=';
    if (word) ++term, --len;
    if (len == 0 || len > n) return 0;
    for (i = 0; i + len <= n; ++i) {
        int same = 1;
        for (j = 0; j < len && same; ++j)
            same = word ? msg[i + j] == term[j] : tolower((unsigned char)msg[i + j]) == tolower((unsigned char)term[j]);
        if (same && (!word || ((i == 0 || !is_ident(msg[i - 1])) && !is_ident(msg[i + len])))) return 1;
    }
    return 0;
}

/* A spec is ';'-separated terms that must all match; a term may list alternatives with '|'. */
static int message_matches(const char *msg, const char *spec) {
    while (*spec) {
        const char *end = spec + strcspn(spec, ";"), *alt = spec;
        int found = 0;
        while (alt < end && !found) {
            const char *bar = alt + strcspn(alt, "|;");
            found = has_term(msg, alt, (size_t)(bar - alt));
            alt = *bar == '|' ? bar + 1 : bar;
        }
        if (!found) return 0;
        spec = *end ? end + 1 : end;
    }
    return 1;
}

static void pass_case(const char *name) {
    ++n_passed;
    printf("ok %s\n", name);
}

static void fail_case(const char *name, flashtile_status got, const char *why) {
    const char *msg = flashtile_last_error();
    ++n_failed;
    printf("FAIL %s: got status %d (%s), message '%s'%s%s\n", name, (int)got, flashtile_status_string(got),
           msg ? msg : "(null)", why ? ": " : "", why ? why : "");
}

/* got must be want (or want2 when want2 >= 0), and the last error must be non-empty and match spec. */
static void expect(const char *name, flashtile_status got, int want, int want2, const char *spec) {
    const char *msg = flashtile_last_error();
    if ((int)got != want && (want2 < 0 || (int)got != want2)) fail_case(name, got, "unexpected status");
    else if (!msg || !*msg) fail_case(name, got, "empty flashtile_last_error() after a failed call");
    else if (!message_matches(msg, spec)) fail_case(name, got, spec);
    else pass_case(name);
}

#define INVALID FLASHTILE_ERROR_INVALID_ARGUMENT

int main(void) {
    flashtile_attention_args a;
    flashtile_attention_grads g = valid_grads();
    size_t bytes = 0;
    int s;

    /* Library-wide strings. */
    for (s = FLASHTILE_SUCCESS; s <= FLASHTILE_ERROR_CUDA; ++s) {
        const char *str = flashtile_status_string((flashtile_status)s);
        char name[64];
        sprintf(name, "status_string_%d", s);
        if (str && *str) pass_case(name);
        else fail_case(name, (flashtile_status)s, "NULL or empty");
    }
    {
        const char *info = flashtile_build_info();
        if (info && *info) pass_case("build_info");
        else fail_case("build_info", FLASHTILE_SUCCESS, "NULL or empty");
    }

    /* What _init promises: struct_size set, no mask, default scale, dense batch. */
    flashtile_attention_args_init(&a);
    if (a.struct_size == (int)sizeof a && a.causal == 0 && a.window_left == -1 && a.window_right == -1 &&
        a.softcap == 0.0f && a.softmax_scale == 0.0f && a.alibi_slopes == NULL && a.cu_seqlens_q == NULL &&
        a.cu_seqlens_k == NULL)
        pass_case("args_init_defaults");
    else
        fail_case("args_init_defaults", FLASHTILE_SUCCESS, "unexpected defaults");

    /* The baseline is valid: its size query succeeds and clears the last error. */
    a = baseline();
    {
        flashtile_status st = flashtile_attention_forward_workspace_size(&a, &bytes);
        const char *msg = flashtile_last_error();
        if (st != FLASHTILE_SUCCESS) fail_case("baseline_workspace_size", st, "the baseline must be valid");
        else if (!msg || *msg) fail_case("baseline_workspace_size", st, "last error not \"\" after a success");
        else pass_case("baseline_workspace_size");
    }

    /* Missing or uninitialised arguments. */
    expect("null_args_forward", flashtile_attention_forward(NULL, FAKE_WORKSPACE, BIG_WORKSPACE, NULL), INVALID, -1,
           "args");
    expect("null_args_workspace_size", flashtile_attention_forward_workspace_size(NULL, &bytes), INVALID, -1, "args");
    expect("null_bytes_workspace_size", flashtile_attention_forward_workspace_size(&a, NULL), INVALID, -1, "bytes");
    a = baseline();
    a.struct_size = 0;
    expect("struct_size_0", forward(&a), INVALID, -1, "struct_size|args_init");

    /* Shapes. */
    a = baseline();
    a.batch = 0;
    expect("batch_0", forward(&a), INVALID, -1, "=batch");
    a = baseline();
    a.seqlen_q = -1;
    expect("seqlen_q_negative", forward(&a), INVALID, -1, "=seqlen_q");
    a = baseline();
    a.nheads = 6;
    a.nheads_k = 4;
    expect("nheads_not_multiple", forward(&a), INVALID, -1, "heads");
    a = baseline();
    a.head_dim = 40;
    a.q.row_stride = a.out.row_stride = (int64_t)H * 40;
    a.k.row_stride = a.v.row_stride = (int64_t)HK * 40;
    a.q.head_stride = a.k.head_stride = a.v.head_stride = a.out.head_stride = 40;
    expect("head_dim_not_exported", forward(&a), FLASHTILE_ERROR_NOT_EXPORTED, -1, "head;flashtile export");
    a = baseline();
    a.dtype = (flashtile_dtype)7;
    expect("dtype_7", forward(&a), INVALID, -1, "dtype");

    /* Tensors: null, misaligned, negative stride. */
    a = baseline();
    a.q.data = NULL;
    expect("q_null", forward(&a), INVALID, -1, "=q");
    a = baseline();
    a.q.data = (void *)(uintptr_t)0x1002;
    expect("q_misaligned", forward(&a), INVALID, -1, "=q;align");
    a = baseline();
    a.q.row_stride = -(int64_t)H * D;
    expect("q_negative_stride", forward(&a), INVALID, -1, "=q");

    /* Features. */
    a = baseline();
    a.window_left = 128;
    expect("window_left", forward(&a), FLASHTILE_ERROR_UNSUPPORTED, FLASHTILE_ERROR_NOT_EXPORTED, "window");

    /* Packed batches. */
    a = packed();
    a.cu_seqlens_k = NULL;
    expect("cu_seqlens_k_null", forward(&a), INVALID, -1, "=cu_seqlens_k");
    a = packed();
    a.max_seqlen_q = 0;
    expect("max_seqlen_q_0", forward(&a), INVALID, -1, "=max_seqlen_q");

    /* Backward. */
    a = baseline();
    expect("backward_grads_null", backward(&a, NULL), INVALID, -1, "grads");
    a.softmax_lse = NULL;
    expect("backward_softmax_lse_null", backward(&a, &g), INVALID, -1, "=softmax_lse");

    /* Workspace: without softmax_lse the forward keeps the logsumexp in its workspace. */
    a = baseline();
    a.softmax_lse = NULL;
    {
        flashtile_status st = flashtile_attention_forward_workspace_size(&a, &bytes);
        if (st != FLASHTILE_SUCCESS) fail_case("workspace_too_small", st, "workspace size query failed");
        else if (bytes <= 1) fail_case("workspace_too_small", st, "size query says <= 1 byte without softmax_lse");
        else
            expect("workspace_too_small", flashtile_attention_forward(&a, FAKE_WORKSPACE, 1, NULL),
                   FLASHTILE_ERROR_WORKSPACE, -1, "workspace");
    }

    /* The kv-cache call. */
    {
        flashtile_kvcache_args kv;
        flashtile_kvcache_args_init(&kv);
        if (kv.struct_size == (int)sizeof kv && kv.window_left == -1 && kv.window_right == -1 && kv.num_splits == 0 &&
            kv.seqlen_new == 0 && kv.k_new.data == NULL && kv.block_table == NULL)
            pass_case("kvcache_args_init_defaults");
        else
            fail_case("kvcache_args_init_defaults", FLASHTILE_SUCCESS, "unexpected defaults");
        kv = kv_baseline();
        flashtile_status st = flashtile_kvcache_forward_workspace_size(&kv, &bytes);
        if (st != FLASHTILE_SUCCESS) fail_case("kvcache_baseline_workspace_size", st, "the baseline must be valid");
        else if (bytes == 0) fail_case("kvcache_baseline_workspace_size", st, "no workspace for the new lengths");
        else pass_case("kvcache_baseline_workspace_size");
        expect("kvcache_null_args", kv_forward(NULL), INVALID, -1, "args");
        kv.struct_size = 4;
        expect("kvcache_struct_size", kv_forward(&kv), INVALID, -1, "struct_size|kvcache_args_init");
        kv = kv_baseline();
        kv.block_table = NULL;
        expect("kvcache_block_table_null", kv_forward(&kv), INVALID, -1, "=block_table");
        kv = kv_baseline();
        kv.cache_seqlens = (const int32_t *)(uintptr_t)0x1004;
        expect("kvcache_cache_seqlens_misaligned", kv_forward(&kv), INVALID, -1, "=cache_seqlens;align");
        kv = kv_baseline();
        kv.seqlen_new = SEQ_PAGES * PAGE + 1;
        expect("kvcache_seqlen_new_over_capacity", kv_forward(&kv), INVALID, -1, "=seqlen_new;capacity");
        kv = kv_baseline();
        kv.v_new.data = NULL;
        expect("kvcache_v_new_null", kv_forward(&kv), INVALID, -1, "=v_new");
        kv = kv_baseline();
        kv.k_cache.data = (void *)(uintptr_t)0x1002;
        expect("kvcache_k_cache_misaligned", kv_forward(&kv), INVALID, -1, "=k_cache;align");
        kv = kv_baseline();
        kv.num_splits = -1;
        expect("kvcache_num_splits_negative", kv_forward(&kv), INVALID, -1, "=num_splits");
        kv = kv_baseline();
        kv.page_size = 16;
        kv.k_cache.batch_stride = kv.v_cache.batch_stride = (int64_t)16 * 2 * D;
        expect("kvcache_page_size_not_exported", kv_forward(&kv), FLASHTILE_ERROR_NOT_EXPORTED, -1,
               "=page_size;page-sizes");
        kv = kv_baseline();
        kv.window_left = 100;
        expect("kvcache_window_not_exported", kv_forward(&kv), FLASHTILE_ERROR_NOT_EXPORTED, -1, "window");
    }

    /* A fully valid call: with no driver it must say libcuda is missing; with one, it would run on
     * the fake pointers, so it is skipped. */
    {
        void *driver = dlopen("libcuda.so.1", RTLD_LAZY);
        if (driver) {
            dlclose(driver);
            printf("skip valid_call_without_driver (libcuda.so.1 is present)\n");
        } else {
            a = baseline();
            if (flashtile_attention_forward_workspace_size(&a, &bytes) != FLASHTILE_SUCCESS) bytes = BIG_WORKSPACE;
            expect("valid_call_without_driver",
                   flashtile_attention_forward(&a, bytes ? FAKE_WORKSPACE : NULL, bytes, NULL), FLASHTILE_ERROR_CUDA,
                   -1, "libcuda");
            flashtile_kvcache_args kv = kv_baseline();
            kv.num_splits = 0; /* automatic: the workspace query asks the device */
            expect("kvcache_auto_splits_without_driver", flashtile_kvcache_forward_workspace_size(&kv, &bytes),
                   FLASHTILE_ERROR_CUDA, -1, "libcuda");
        }
    }

    printf("check_errors: %d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
