// varlen_inference: attention forward over a packed batch of variable-length sequences through
// flashtile's C API, the layout an inference engine uses for prefill.
//
// The sequences are packed back to back into (total, heads, head_dim) tensors and described by
// cu_seqlens (int32 prefix sums). The output and softmax_lse are checked per sequence against a
// double-precision CPU reference, then the forward is timed with CUDA events. --dump DIR writes the
// inputs and results as raw binaries plus meta.json for comparison with flashtile's Python API.
//
// Usage: varlen_inference [--lengths L1,L2,...] [--heads N] [--heads-k N] [--head-dim N]
//                         [--dtype bf16|fp16] [--causal | --no-causal] [--iters N] [--seed N]
//                         [--dump DIR]

#include <cuda_runtime.h>

#include "flashtile.h"

#include "example_common.hpp"  // the helpers shared with mha_fwd_bwd (ex::), CUDA_CHECK, FT_CHECK

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// Command line.

struct Options : ex::CommonOptions {
    std::vector<int> lengths = {1, 113, 1023, 4096, 517};
    Options() : CommonOptions(/*heads=*/32, /*heads_k=*/8, /*head_dim=*/128, /*causal=*/true) {}
};

const char kUsage[] =
    "usage: varlen_inference [--lengths L1,L2,...] [--heads N] [--heads-k N] [--head-dim N]\n"
    "                        [--dtype bf16|fp16] [--causal | --no-causal] [--iters N] [--seed N]\n"
    "                        [--dump DIR]\n";

std::vector<int> parse_lengths(const ex::ArgReader &a, const std::string &text) {
    std::vector<int> out;
    size_t pos = 0;
    while (pos <= text.size()) {
        const size_t comma = std::min(text.find(',', pos), text.size());
        out.push_back(a.to_int("--lengths", text.substr(pos, comma - pos), 0));
        pos = comma + 1;
    }
    return out;
}

Options parse_args(int argc, char **argv) {
    Options o;
    ex::ArgReader a(argc, argv, "varlen_inference", kUsage);
    while (a.next()) {
        if (a.is("--lengths")) o.lengths = parse_lengths(a, a.value());
        else if (a.is_flag("--no-causal")) o.causal = false;
        else if (!ex::read_common_option(a, o)) a.unknown();
    }
    ex::check_common_options(a, o);
    long long total = 0;
    for (int len : o.lengths) total += len;
    if (total == 0 || total > std::numeric_limits<int32_t>::max()) a.usage("--lengths must add up to 1 .. 2^31-1 rows");
    return o;
}

// ---------------------------------------------------------------------------------------------
// CPU reference in double for one query row of one sequence and head. Packed layouts: q / out
// (total, h, d), k / v (total, hk, d). Within a sequence seqlen_q == seqlen_k, so the causal mask
// lets query i see keys 0..i.

void reference_row(const std::vector<double> &q, const std::vector<double> &k, const std::vector<double> &v, int H,
                   int HK, int D, int start, int len, int i, int head, bool causal, double scale,
                   std::vector<double> &p, double *out_row, double *lse) {
    const int kh = head / (H / HK);  // GQA: query head reads kv head head / group
    const double *qi = &q[(static_cast<size_t>(start + i) * H + head) * D];
    const int nvis = causal ? i + 1 : len;
    auto koff = [&](int j) { return (static_cast<size_t>(start + j) * HK + kh) * D; };
    std::fill(out_row, out_row + D, 0.0);
    *lse = ex::attention_row(qi, nvis, D, scale, [&](int j) { return &k[koff(j)]; }, [&](int j) { return &v[koff(j)]; },
                             p, out_row);
}

}  // namespace

int main(int argc, char **argv) {
    const Options o = parse_args(argc, argv);
    const int H = o.heads, HK = o.heads_k, D = o.head_dim, nseq = static_cast<int>(o.lengths.size());
    const ex::Dtype16 dtype{o.bf16};
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));

    // cu_seqlens: prefix sums of the lengths, batch + 1 values (the same for queries and keys).
    std::vector<int32_t> cu_seqlens(nseq + 1, 0);
    int max_len = 0;
    std::string lengths_text;
    for (int s = 0; s < nseq; ++s) {
        cu_seqlens[s + 1] = cu_seqlens[s] + o.lengths[s];
        max_len = std::max(max_len, o.lengths[s]);
        lengths_text += (s ? "," : "") + std::to_string(o.lengths[s]);
    }
    const int total = cu_seqlens[nseq];

    std::printf("varlen_inference: %d sequences [%s] (total %d, longest %d) heads %d heads_k %d head_dim %d %s%s\n",
                nseq, lengths_text.c_str(), total, max_len, H, HK, D, dtype.name(), o.causal ? " causal" : "");
    std::printf("flashtile: %s\n", flashtile_build_info());

    const size_t nq = static_cast<size_t>(total) * H * D, nk = static_cast<size_t>(total) * HK * D;
    const size_t nlse = static_cast<size_t>(H) * total;

    // Random inputs, rounded to the 16-bit type: .bits for the GPU, .vals for the reference.
    ex::RandomRounded random(o.seed, dtype);
    const ex::Rounded16 q = random(nq), k = random(nk), v = random(nk);

    // Device buffers. Outputs start as all-ones bytes (NaN in every type) so unwritten values show.
    CUDA_CHECK(cudaSetDevice(0));
    void *d_q = ex::device_alloc(nq * 2), *d_k = ex::device_alloc(nk * 2), *d_v = ex::device_alloc(nk * 2);
    void *d_out = ex::device_alloc(nq * 2);
    float *d_lse = static_cast<float *>(ex::device_alloc(nlse * sizeof(float)));
    int32_t *d_cu = static_cast<int32_t *>(ex::device_alloc(cu_seqlens.size() * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(d_q, q.bits.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_k, k.bits.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_v, v.bits.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_cu, cu_seqlens.data(), cu_seqlens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0xff, nq * 2));
    CUDA_CHECK(cudaMemset(d_lse, 0xff, nlse * sizeof(float)));

    // Packed tensors: rows counted over the whole batch, so batch_stride is unused (0).
    flashtile_attention_args args;
    flashtile_attention_args_init(&args);
    args.dtype = o.bf16 ? FLASHTILE_BFLOAT16 : FLASHTILE_FLOAT16;
    args.batch = nseq;
    args.seqlen_q = args.seqlen_k = total;  // packed: total rows, queries and keys alike
    args.nheads = H;
    args.nheads_k = HK;
    args.head_dim = D;
    args.q = {d_q, 0, static_cast<int64_t>(H) * D, D};
    args.k = {d_k, 0, static_cast<int64_t>(HK) * D, D};
    args.v = {d_v, 0, static_cast<int64_t>(HK) * D, D};
    args.out = {d_out, 0, static_cast<int64_t>(H) * D, D};
    args.softmax_lse = d_lse;  // (heads, total) float32
    args.causal = o.causal ? 1 : 0;
    args.cu_seqlens_q = args.cu_seqlens_k = d_cu;  // queries and keys share the lengths here
    args.max_seqlen_q = args.max_seqlen_k = max_len;

    size_t ws_bytes = 0;
    FT_CHECK(flashtile_attention_forward_workspace_size(&args, &ws_bytes));
    void *ws = ex::device_alloc(ws_bytes);
    std::printf("workspace: forward %zu bytes\n", ws_bytes);

    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));  // cudaStream_t and flashtile_stream_t are the same type
    auto forward = [&] { FT_CHECK(flashtile_attention_forward(&args, ws, ws_bytes, stream)); };
    forward();
    CUDA_CHECK(cudaStreamSynchronize(stream));

    std::vector<uint16_t> hout(nq);
    std::vector<float> lse(nlse);
    CUDA_CHECK(cudaMemcpy(hout.data(), d_out, nq * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(lse.data(), d_lse, nlse * sizeof(float), cudaMemcpyDeviceToHost));

    // Reference. Each query row is independent, so the reference can check a sample of rows: the
    // ~2e9 multiply-adds per product it affords are shared equally by the sequences, and a sequence
    // that would cost more checks every stride-th query row (and its last one).
    std::vector<long long> strides(nseq, 1);
    std::string stride_text;
    for (int s = 0; s < nseq; ++s) {
        const double cost = static_cast<double>(H) * o.lengths[s] * o.lengths[s] * D * (o.causal ? 0.5 : 1.0);
        strides[s] = std::max(1LL, static_cast<long long>(std::ceil(cost / (2e9 / nseq))));
        stride_text += (s ? "," : "") + std::to_string(strides[s]);
    }
    if (*std::max_element(strides.begin(), strides.end()) > 1)
        std::printf("reference: problem is large, checking every n-th query row per sequence, n = [%s]\n",
                    stride_text.c_str());

    const ex::Tolerances tol = ex::tolerances(o.bf16);
    double out_err = 0, out_ref_max = 0, lse_err = 0;
    size_t rows_checked = 0, nonfinite = 0;
    std::vector<double> p(std::max(max_len, 1)), ref_out(D);
    for (int s = 0; s < nseq; ++s) {
        const int start = cu_seqlens[s], len = o.lengths[s];
        for (int i = 0; i < len; ++i) {
            if (i % strides[s] != 0 && i != len - 1) continue;
            ++rows_checked;
            for (int h = 0; h < H; ++h) {
                double ref_lse;
                reference_row(q.vals, k.vals, v.vals, H, HK, D, start, len, i, h, o.causal, scale, p, ref_out.data(),
                              &ref_lse);
                const uint16_t *got = &hout[(static_cast<size_t>(start + i) * H + h) * D];
                for (int x = 0; x < D; ++x) {
                    out_err = std::max(out_err, ex::abs_err(dtype.to_float(got[x]), ref_out[x]));
                    out_ref_max = std::max(out_ref_max, std::fabs(ref_out[x]));
                }
                lse_err = std::max(lse_err, ex::abs_err(lse[static_cast<size_t>(h) * total + start + i], ref_lse));
            }
        }
    }
    // Rows the reference skipped must still have been written (no NaN / inf left over).
    for (uint16_t b : hout) nonfinite += !std::isfinite(dtype.to_float(b));
    for (float l : lse) nonfinite += !std::isfinite(l);

    std::printf("check against the CPU reference (double), %zu of %d query rows x %d heads:\n", rows_checked, total,
                H);
    const bool out_ok = ex::report_check("out", out_err, out_ref_max, tol.atol + tol.rtol * out_ref_max);
    const bool lse_ok = lse_err <= tol.lse, finite_ok = nonfinite == 0;
    const bool pass = out_ok && lse_ok && finite_ok;
    std::printf("  lse  max abs err %.3e  (tol %.3e)  %s\n", lse_err, tol.lse, lse_ok ? "ok" : "FAIL");
    std::printf("  all out / lse values finite: %s (%zu not)\n", finite_ok ? "ok" : "FAIL", nonfinite);

    // meta.json: seqlen_q / seqlen_k are the packed totals, as in the call's arguments.
    if (!o.dump.empty())
        ex::write_dump("varlen_inference", o.dump,
                       {{"q.bin", q.bits}, {"k.bin", k.bits}, {"v.bin", v.bits}, {"out.bin", hout}, {"lse.bin", lse},
                        {"meta.json", ex::meta_json(args, dtype.name(), scale, ", \"lengths\": [" + lengths_text + "]")}});

    // Timing (ex::EventTimer): 3 warm-up calls, then --iters calls between two events on the stream.
    // FLOPs: two matmuls of 2*len*len*d per sequence and head, half of that when causal.
    double flops = 0;
    for (int len : o.lengths) flops += 4.0 * H * len * len * D * (o.causal ? 0.5 : 1.0);
    double ms = 0;
    if (o.iters > 0) {
        ex::EventTimer timer(stream);
        ms = timer.ms_per_call(o.iters, forward);
        std::printf("timing (%d iters): forward %.3f ms (%.1f TFLOP/s)\n", o.iters, ms, flops / (ms * 1e9));
    }

    CUDA_CHECK(cudaStreamDestroy(stream));
    ex::device_free_all({d_q, d_k, d_v, d_out, d_lse, d_cu, ws});

    if (o.iters > 0)
        std::printf("varlen_inference: %s fwd %.3f ms (%.1f TFLOP/s)\n", pass ? "PASS" : "FAIL", ms,
                    flops / (ms * 1e9));
    else
        std::printf("varlen_inference: %s (not timed)\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
