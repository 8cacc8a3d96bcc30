// mha_fwd_bwd: dense multi-head attention, forward and backward, through flashtile's C API.
//
// Fills q, k, v and dout with random values, rounds them to bf16 / fp16 on the host, runs
// flashtile_attention_forward and flashtile_attention_backward, checks out, softmax_lse, dq, dk and
// dv against a double-precision CPU reference computed from the same rounded inputs, then times both
// calls with CUDA events. --dump DIR writes the inputs and results as raw binaries plus meta.json so
// that a Python script can compare them with flashtile's Python API.
//
// Usage: mha_fwd_bwd [--batch N] [--seqlen-q N] [--seqlen-k N] [--heads N] [--heads-k N]
//                    [--head-dim N] [--dtype bf16|fp16] [--causal] [--iters N] [--seed N] [--dump DIR]

#include <cuda_runtime.h>

#include "flashtile.h"

#include "example_common.hpp"  // the helpers shared with varlen_inference (ex::), CUDA_CHECK, FT_CHECK

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
    int batch = 2, seqlen_q = 512, seqlen_k = -1;  // seqlen_k -1: as many as seqlen_q
    Options() : CommonOptions(/*heads=*/8, /*heads_k=*/-1, /*head_dim=*/128, /*causal=*/false) {}
};

const char kUsage[] =
    "usage: mha_fwd_bwd [--batch N] [--seqlen-q N] [--seqlen-k N] [--heads N] [--heads-k N]\n"
    "                   [--head-dim N] [--dtype bf16|fp16] [--causal] [--iters N] [--seed N]\n"
    "                   [--dump DIR]\n";

Options parse_args(int argc, char **argv) {
    Options o;
    ex::ArgReader a(argc, argv, "mha_fwd_bwd", kUsage);
    while (a.next()) {
        if (a.is("--batch")) o.batch = a.int_value(1);
        else if (a.is("--seqlen-q")) o.seqlen_q = a.int_value(1);
        else if (a.is("--seqlen-k")) o.seqlen_k = a.int_value(1);
        else if (!ex::read_common_option(a, o)) a.unknown();
    }
    if (o.seqlen_k < 0) o.seqlen_k = o.seqlen_q;
    ex::check_common_options(a, o);
    return o;
}

// ---------------------------------------------------------------------------------------------
// CPU reference in double. Layouts are contiguous (b, s, h, d); lse is (b, h, sq).

struct Shape {
    int b, sq, sk, h, hk, d;
    bool causal;
    double scale;
};

struct Reference {
    std::vector<double> out, lse, dq, dk, dv;
};

// Forward and backward for the first nb batch elements. Query i sees key j iff j <= i + sk - sq
// (causal, bottom-right aligned); a row that sees no key has out 0, lse -inf and no gradient.
Reference reference(const Shape &s, int nb, const std::vector<double> &q, const std::vector<double> &k,
                    const std::vector<double> &v, const std::vector<double> &dout) {
    const size_t nq = static_cast<size_t>(nb) * s.sq * s.h * s.d;
    const size_t nk = static_cast<size_t>(nb) * s.sk * s.hk * s.d;
    Reference r;
    r.out.assign(nq, 0.0);
    r.dq.assign(nq, 0.0);
    r.dk.assign(nk, 0.0);
    r.dv.assign(nk, 0.0);
    r.lse.assign(static_cast<size_t>(nb) * s.h * s.sq, 0.0);
    const int group = s.h / s.hk, d = s.d;
    std::vector<double> p(s.sk);
    for (int bi = 0; bi < nb; ++bi) {
        for (int hi = 0; hi < s.h; ++hi) {
            const int kh = hi / group;  // GQA: query head hi reads kv head hi / group
            for (int i = 0; i < s.sq; ++i) {
                const size_t qoff = ((static_cast<size_t>(bi) * s.sq + i) * s.h + hi) * d;
                double &lse = r.lse[(static_cast<size_t>(bi) * s.h + hi) * s.sq + i];
                const long long last = s.causal ? static_cast<long long>(i) + s.sk - s.sq : s.sk - 1;
                const int nvis = static_cast<int>(std::min<long long>(std::max<long long>(last + 1, 0), s.sk));
                if (nvis == 0) {
                    lse = -std::numeric_limits<double>::infinity();
                    continue;
                }
                auto koff = [&](int j) { return ((static_cast<size_t>(bi) * s.sk + j) * s.hk + kh) * d; };
                const double *qi = &q[qoff];
                double *oi = &r.out[qoff];
                lse = ex::attention_row(qi, nvis, d, s.scale, [&](int j) { return &k[koff(j)]; },
                                        [&](int j) { return &v[koff(j)]; }, p, oi);  // p: the probabilities
                // Backward: dS = P * (dP - D) with dP = dout v^T and D = rowsum(dout * out).
                const double *doi = &dout[qoff];
                double D = 0;
                for (int x = 0; x < d; ++x) D += doi[x] * oi[x];
                double *dqi = &r.dq[qoff];
                for (int j = 0; j < nvis; ++j) {
                    const double *vj = &v[koff(j)], *kj = &k[koff(j)];
                    double dp = 0;
                    for (int x = 0; x < d; ++x) dp += doi[x] * vj[x];
                    const double ds = p[j] * (dp - D) * s.scale;
                    double *dkj = &r.dk[koff(j)], *dvj = &r.dv[koff(j)];
                    for (int x = 0; x < d; ++x) {
                        dqi[x] += ds * kj[x];
                        dkj[x] += ds * qi[x];  // summed over the query heads of the group
                        dvj[x] += p[j] * doi[x];
                    }
                }
            }
        }
    }
    return r;
}

// Max abs difference over the first n values; a NaN or inf in the library's result counts as inf.
// A row the reference leaves at lse = -inf matches any infinite (or hugely negative) value.
double max_abs_err(const std::vector<float> &got, const std::vector<double> &ref, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; ++i) {
        double e;
        if (std::isinf(ref[i])) e = (std::isinf(got[i]) || std::fabs(got[i]) >= 1e30f) ? 0.0 : INFINITY;
        else e = ex::abs_err(got[i], ref[i]);
        worst = std::max(worst, e);
    }
    return worst;
}

double max_abs(const std::vector<double> &v, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; ++i)
        if (std::isfinite(v[i])) m = std::max(m, std::fabs(v[i]));
    return m;
}

}  // namespace

int main(int argc, char **argv) {
    const Options o = parse_args(argc, argv);
    const int B = o.batch, SQ = o.seqlen_q, SK = o.seqlen_k, H = o.heads, HK = o.heads_k, D = o.head_dim;
    const ex::Dtype16 dtype{o.bf16};
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));

    std::printf("mha_fwd_bwd: batch %d seqlen_q %d seqlen_k %d heads %d heads_k %d head_dim %d %s%s\n", B, SQ, SK,
                H, HK, D, dtype.name(), o.causal ? " causal" : "");
    std::printf("flashtile: %s\n", flashtile_build_info());

    const size_t nq = static_cast<size_t>(B) * SQ * H * D;   // q, out, dout, dq
    const size_t nk = static_cast<size_t>(B) * SK * HK * D;  // k, v, dk, dv
    const size_t nlse = static_cast<size_t>(B) * H * SQ;

    // Random inputs, rounded to the 16-bit type: .bits for the GPU, .vals for the reference.
    ex::RandomRounded random(o.seed, dtype);
    const ex::Rounded16 q = random(nq), k = random(nk), v = random(nk), dout = random(nq);

    // Device buffers. Outputs start as all-ones bytes (NaN in every type) so unwritten values show.
    CUDA_CHECK(cudaSetDevice(0));
    void *d_q = ex::device_alloc(nq * 2), *d_k = ex::device_alloc(nk * 2), *d_v = ex::device_alloc(nk * 2);
    void *d_out = ex::device_alloc(nq * 2), *d_dout = ex::device_alloc(nq * 2);
    void *d_dq = ex::device_alloc(nq * 2), *d_dk = ex::device_alloc(nk * 2), *d_dv = ex::device_alloc(nk * 2);
    float *d_lse = static_cast<float *>(ex::device_alloc(nlse * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(d_q, q.bits.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_k, k.bits.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_v, v.bits.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_dout, dout.bits.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0xff, nq * 2));
    CUDA_CHECK(cudaMemset(d_dq, 0xff, nq * 2));
    CUDA_CHECK(cudaMemset(d_dk, 0xff, nk * 2));
    CUDA_CHECK(cudaMemset(d_dv, 0xff, nk * 2));
    CUDA_CHECK(cudaMemset(d_lse, 0xff, nlse * sizeof(float)));

    // The call's arguments: contiguous (b, s, h, d) tensors, strides in elements. q_like and k_like
    // are the two layouts (q, out, dout, dq and k, v, dk, dv); with() gives one its data.
    const flashtile_tensor q_like = {nullptr, static_cast<int64_t>(SQ) * H * D, static_cast<int64_t>(H) * D, D};
    const flashtile_tensor k_like = {nullptr, static_cast<int64_t>(SK) * HK * D, static_cast<int64_t>(HK) * D, D};
    auto with = [](flashtile_tensor t, void *data) { t.data = data; return t; };
    flashtile_attention_args args;
    flashtile_attention_args_init(&args);
    args.dtype = o.bf16 ? FLASHTILE_BFLOAT16 : FLASHTILE_FLOAT16;
    args.batch = B;
    args.seqlen_q = SQ;
    args.seqlen_k = SK;
    args.nheads = H;
    args.nheads_k = HK;
    args.head_dim = D;
    args.q = with(q_like, d_q);
    args.k = with(k_like, d_k);
    args.v = with(k_like, d_v);
    args.out = with(q_like, d_out);
    args.softmax_lse = d_lse;  // kept for the backward
    args.causal = o.causal ? 1 : 0;
    // softmax_scale stays 0: the library's default, 1 / sqrt(head_dim).

    flashtile_attention_grads grads;
    grads.dout = with(q_like, d_dout);
    grads.dq = with(q_like, d_dq);
    grads.dk = with(k_like, d_dk);
    grads.dv = with(k_like, d_dv);

    size_t fwd_ws_bytes = 0, bwd_ws_bytes = 0;
    FT_CHECK(flashtile_attention_forward_workspace_size(&args, &fwd_ws_bytes));
    FT_CHECK(flashtile_attention_backward_workspace_size(&args, &bwd_ws_bytes));
    void *fwd_ws = ex::device_alloc(fwd_ws_bytes), *bwd_ws = ex::device_alloc(bwd_ws_bytes);
    std::printf("workspace: forward %zu bytes, backward %zu bytes\n", fwd_ws_bytes, bwd_ws_bytes);

    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));  // cudaStream_t and flashtile_stream_t are the same type
    auto forward = [&] { FT_CHECK(flashtile_attention_forward(&args, fwd_ws, fwd_ws_bytes, stream)); };
    auto backward = [&] { FT_CHECK(flashtile_attention_backward(&args, &grads, bwd_ws, bwd_ws_bytes, stream)); };

    forward();
    backward();
    CUDA_CHECK(cudaStreamSynchronize(stream));

    // Results back to the host.
    std::vector<uint16_t> hout(nq), hdq(nq), hdk(nk), hdv(nk);
    std::vector<float> lse(nlse);
    CUDA_CHECK(cudaMemcpy(hout.data(), d_out, nq * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hdq.data(), d_dq, nq * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hdk.data(), d_dk, nk * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hdv.data(), d_dv, nk * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(lse.data(), d_lse, nlse * sizeof(float), cudaMemcpyDeviceToHost));
    auto widen = [&](const std::vector<uint16_t> &bits) {
        std::vector<float> f(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) f[i] = dtype.to_float(bits[i]);
        return f;
    };

    // Reference. Past ~2e9 multiply-adds per product the double loops get slow: check batch 0 only.
    const Shape shape = {B, SQ, SK, H, HK, D, o.causal, scale};
    const double work = static_cast<double>(B) * H * SQ * SK * D;
    const int nb = work > 2e9 ? 1 : B;
    if (nb < B) std::printf("reference: problem is large, checking only the first batch element\n");
    const Reference ref = reference(shape, nb, q.vals, k.vals, v.vals, dout.vals);
    const size_t cq = static_cast<size_t>(nb) * SQ * H * D, ck = static_cast<size_t>(nb) * SK * HK * D;
    const size_t clse = static_cast<size_t>(nb) * H * SQ;

    const ex::Tolerances tol = ex::tolerances(o.bf16);
    bool pass = true;
    auto check = [&](const char *name, const std::vector<float> &got, const std::vector<double> &want, size_t n,
                     bool is_lse) {
        const double err = max_abs_err(got, want, n), ref_max = max_abs(want, n);
        const bool ok = ex::report_check(name, err, ref_max, is_lse ? tol.lse : tol.atol + tol.rtol * ref_max);
        pass = pass && ok;
    };
    std::printf("check against the CPU reference (double):\n");
    check("out", widen(hout), ref.out, cq, false);
    check("lse", lse, ref.lse, clse, true);
    check("dq", widen(hdq), ref.dq, cq, false);
    check("dk", widen(hdk), ref.dk, ck, false);
    check("dv", widen(hdv), ref.dv, ck, false);

    if (!o.dump.empty())
        ex::write_dump("mha_fwd_bwd", o.dump,
                       {{"q.bin", q.bits}, {"k.bin", k.bits}, {"v.bin", v.bits}, {"dout.bin", dout.bits},
                        {"out.bin", hout}, {"dq.bin", hdq}, {"dk.bin", hdk}, {"dv.bin", hdv}, {"lse.bin", lse},
                        {"meta.json", ex::meta_json(args, dtype.name(), scale)}});

    // Timing (ex::EventTimer): 3 warm-up calls, then --iters calls between two events on the stream.
    // FLOPs: two (forward) or five (backward) matmuls of 2*sq*sk*d each per head; causal with
    // sq == sk counts half, other causal shapes count the visible (query, key) pairs.
    double pairs = static_cast<double>(SQ) * SK;
    if (o.causal) {
        if (SQ == SK) pairs /= 2;
        else {
            pairs = 0;
            for (long long i = 0; i < SQ; ++i) pairs += static_cast<double>(std::min<long long>(std::max<long long>(i + SK - SQ + 1, 0), SK));
        }
    }
    const double fwd_flops = 4.0 * B * H * pairs * D, bwd_flops = 2.5 * fwd_flops;
    double fwd_ms = 0, bwd_ms = 0;
    if (o.iters > 0) {
        ex::EventTimer timer(stream);
        fwd_ms = timer.ms_per_call(o.iters, forward);
        bwd_ms = timer.ms_per_call(o.iters, backward);
        CUDA_CHECK(cudaGetLastError());
        std::printf("timing (%d iters): forward %.3f ms (%.1f TFLOP/s), backward %.3f ms (%.1f TFLOP/s)\n", o.iters,
                    fwd_ms, fwd_flops / (fwd_ms * 1e9), bwd_ms, bwd_flops / (bwd_ms * 1e9));
    }

    CUDA_CHECK(cudaStreamDestroy(stream));
    ex::device_free_all({d_q, d_k, d_v, d_out, d_dout, d_dq, d_dk, d_dv, d_lse, fwd_ws, bwd_ws});

    if (o.iters > 0)
        std::printf("mha_fwd_bwd: %s fwd %.3f ms (%.1f TFLOP/s) bwd %.3f ms (%.1f TFLOP/s)\n", pass ? "PASS" : "FAIL",
                    fwd_ms, fwd_flops / (fwd_ms * 1e9), bwd_ms, bwd_flops / (bwd_ms * 1e9));
    else
        std::printf("mha_fwd_bwd: %s (not timed)\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
