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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// 16-bit floating point on the host (round to nearest even, like the GPU's conversions).

uint16_t float_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);  // ties go to the even upper half
    return static_cast<uint16_t>(x >> 16);
}

float bf16_to_float(uint16_t h) {
    uint32_t x = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}

uint16_t float_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x0200u : 0u));
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {  // below 2^-14: an fp16 subnormal (or zero), counted in units of 2^-24
        const uint32_t e = ax >> 23;
        const uint32_t shift = 126u - e;  // value / 2^-24 == mantissa >> shift
        if (shift > 24u) return static_cast<uint16_t>(sign);
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: fine
        return static_cast<uint16_t>(sign | q);
    }
    uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is correct
    return static_cast<uint16_t>(sign | h);
}

float fp16_to_float(uint16_t h) {
    const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        const float v = std::ldexp(static_cast<float>(mant), -24);
        return sign ? -v : v;
    }
    const uint32_t x = sign | (exp == 31 ? (0xffu << 23) | (mant << 13) : ((exp + 112u) << 23) | (mant << 13));
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}

// ---------------------------------------------------------------------------------------------
// Error handling: every failure ends the program with a message and exit status 1.

#define CUDA_CHECK(call)                                                                            \
    do {                                                                                            \
        cudaError_t err_ = (call);                                                                  \
        if (err_ != cudaSuccess) {                                                                  \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            std::exit(1);                                                                           \
        }                                                                                           \
    } while (0)

#define FT_CHECK(call)                                                                              \
    do {                                                                                            \
        flashtile_status st_ = (call);                                                              \
        if (st_ != FLASHTILE_SUCCESS) {                                                             \
            std::fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,                  \
                         flashtile_status_string(st_), flashtile_last_error());                     \
            std::exit(1);                                                                           \
        }                                                                                           \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Command line.

struct Options {
    int batch = 2, seqlen_q = 512, seqlen_k = -1, heads = 8, heads_k = -1, head_dim = 128;
    bool bf16 = true, causal = false;
    int iters = 20;
    unsigned seed = 0;
    std::string dump;
};

[[noreturn]] void usage(const char *msg) {
    if (msg) std::fprintf(stderr, "mha_fwd_bwd: %s\n", msg);
    std::fprintf(stderr,
                 "usage: mha_fwd_bwd [--batch N] [--seqlen-q N] [--seqlen-k N] [--heads N] [--heads-k N]\n"
                 "                   [--head-dim N] [--dtype bf16|fp16] [--causal] [--iters N] [--seed N]\n"
                 "                   [--dump DIR]\n");
    std::exit(msg ? 1 : 0);
}

long parse_int(const std::string &name, const std::string &text, long lo) {
    char *end = nullptr;
    const long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || v < lo || v > std::numeric_limits<int>::max())
        usage(("bad value for " + name + ": '" + text + "'").c_str());
    return v;
}

Options parse_args(int argc, char **argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i], value;
        const bool has_eq = arg.find('=') != std::string::npos;
        if (has_eq) {  // accept --opt=value as well as --opt value
            value = arg.substr(arg.find('=') + 1);
            arg = arg.substr(0, arg.find('='));
        }
        auto next = [&]() -> std::string {
            if (has_eq) return value;
            if (i + 1 >= argc) usage(("missing value for " + arg).c_str());
            return argv[++i];
        };
        if (arg == "--batch") o.batch = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--seqlen-q") o.seqlen_q = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--seqlen-k") o.seqlen_k = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--heads") o.heads = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--heads-k") o.heads_k = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--head-dim") o.head_dim = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--iters") o.iters = static_cast<int>(parse_int(arg, next(), 0));
        else if (arg == "--seed") o.seed = static_cast<unsigned>(parse_int(arg, next(), 0));
        else if (arg == "--dump") o.dump = next();
        else if (arg == "--causal" && !has_eq) o.causal = true;
        else if (arg == "--dtype") {
            const std::string d = next();
            if (d == "bf16" || d == "bfloat16") o.bf16 = true;
            else if (d == "fp16" || d == "float16") o.bf16 = false;
            else usage(("bad --dtype '" + d + "' (bf16 or fp16)").c_str());
        } else if (arg == "-h" || arg == "--help") usage(nullptr);
        else usage(("unknown option " + arg).c_str());
    }
    if (o.seqlen_k < 0) o.seqlen_k = o.seqlen_q;
    if (o.heads_k < 0) o.heads_k = o.heads;
    if (o.heads % o.heads_k != 0) usage("--heads must be a multiple of --heads-k");
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
                double m = -std::numeric_limits<double>::infinity();
                for (int j = 0; j < nvis; ++j) {
                    const double *kj = &k[koff(j)];
                    double dot = 0;
                    for (int x = 0; x < d; ++x) dot += qi[x] * kj[x];
                    p[j] = dot * s.scale;
                    m = std::max(m, p[j]);
                }
                double sum = 0;
                for (int j = 0; j < nvis; ++j) sum += (p[j] = std::exp(p[j] - m));
                lse = m + std::log(sum);
                double *oi = &r.out[qoff];
                for (int j = 0; j < nvis; ++j) {
                    p[j] /= sum;
                    const double *vj = &v[koff(j)];
                    for (int x = 0; x < d; ++x) oi[x] += p[j] * vj[x];
                }
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
        else e = std::isfinite(got[i]) ? std::fabs(got[i] - ref[i]) : INFINITY;
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

// ---------------------------------------------------------------------------------------------
// Small helpers.

void *device_alloc(size_t bytes) {
    void *p = nullptr;
    if (bytes) CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
}

void write_file(const std::string &dir, const char *name, const void *data, size_t bytes) {
    const std::string path = dir + "/" + name;
    FILE *f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(data, 1, bytes, f) != bytes || std::fclose(f) != 0) {
        std::fprintf(stderr, "mha_fwd_bwd: cannot write %s\n", path.c_str());
        std::exit(1);
    }
}

bool little_endian() {
    const uint16_t one = 1;
    unsigned char c;
    std::memcpy(&c, &one, 1);
    return c == 1;
}

}  // namespace

int main(int argc, char **argv) {
    const Options o = parse_args(argc, argv);
    const int B = o.batch, SQ = o.seqlen_q, SK = o.seqlen_k, H = o.heads, HK = o.heads_k, D = o.head_dim;
    const char *dtype_name = o.bf16 ? "bf16" : "fp16";
    auto to16 = o.bf16 ? float_to_bf16 : float_to_fp16;
    auto from16 = o.bf16 ? bf16_to_float : fp16_to_float;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));

    std::printf("mha_fwd_bwd: batch %d seqlen_q %d seqlen_k %d heads %d heads_k %d head_dim %d %s%s\n", B, SQ, SK,
                H, HK, D, dtype_name, o.causal ? " causal" : "");
    std::printf("flashtile: %s\n", flashtile_build_info());

    const size_t nq = static_cast<size_t>(B) * SQ * H * D;   // q, out, dout, dq
    const size_t nk = static_cast<size_t>(B) * SK * HK * D;  // k, v, dk, dv
    const size_t nlse = static_cast<size_t>(B) * H * SQ;

    // Random inputs, rounded to the 16-bit type: the reference sees exactly what the GPU sees.
    std::mt19937 rng(o.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto make = [&](size_t n, std::vector<uint16_t> &bits, std::vector<double> &vals) {
        bits.resize(n);
        vals.resize(n);
        for (size_t i = 0; i < n; ++i) {
            bits[i] = to16(normal(rng));
            vals[i] = from16(bits[i]);
        }
    };
    std::vector<uint16_t> hq, hk, hv, hdout;
    std::vector<double> q, k, v, dout;
    make(nq, hq, q);
    make(nk, hk, k);
    make(nk, hv, v);
    make(nq, hdout, dout);

    // Device buffers. Outputs start as all-ones bytes (NaN in every type) so unwritten values show.
    CUDA_CHECK(cudaSetDevice(0));
    void *d_q = device_alloc(nq * 2), *d_k = device_alloc(nk * 2), *d_v = device_alloc(nk * 2);
    void *d_out = device_alloc(nq * 2), *d_dout = device_alloc(nq * 2);
    void *d_dq = device_alloc(nq * 2), *d_dk = device_alloc(nk * 2), *d_dv = device_alloc(nk * 2);
    float *d_lse = static_cast<float *>(device_alloc(nlse * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(d_q, hq.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_v, hv.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_dout, hdout.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0xff, nq * 2));
    CUDA_CHECK(cudaMemset(d_dq, 0xff, nq * 2));
    CUDA_CHECK(cudaMemset(d_dk, 0xff, nk * 2));
    CUDA_CHECK(cudaMemset(d_dv, 0xff, nk * 2));
    CUDA_CHECK(cudaMemset(d_lse, 0xff, nlse * sizeof(float)));

    // The call's arguments: contiguous (b, s, h, d) tensors, strides in elements.
    flashtile_attention_args args;
    flashtile_attention_args_init(&args);
    args.dtype = o.bf16 ? FLASHTILE_BFLOAT16 : FLASHTILE_FLOAT16;
    args.batch = B;
    args.seqlen_q = SQ;
    args.seqlen_k = SK;
    args.nheads = H;
    args.nheads_k = HK;
    args.head_dim = D;
    const flashtile_tensor q_like = {nullptr, static_cast<int64_t>(SQ) * H * D, static_cast<int64_t>(H) * D, D};
    const flashtile_tensor k_like = {nullptr, static_cast<int64_t>(SK) * HK * D, static_cast<int64_t>(HK) * D, D};
    auto with = [](flashtile_tensor t, void *data) { t.data = data; return t; };
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
    void *fwd_ws = device_alloc(fwd_ws_bytes), *bwd_ws = device_alloc(bwd_ws_bytes);
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
        for (size_t i = 0; i < bits.size(); ++i) f[i] = from16(bits[i]);
        return f;
    };

    // Reference. Past ~2e9 multiply-adds per product the double loops get slow: check batch 0 only.
    const Shape shape = {B, SQ, SK, H, HK, D, o.causal, scale};
    const double work = static_cast<double>(B) * H * SQ * SK * D;
    const int nb = work > 2e9 ? 1 : B;
    if (nb < B) std::printf("reference: problem is large, checking only the first batch element\n");
    const Reference ref = reference(shape, nb, q, k, v, dout);
    const size_t cq = static_cast<size_t>(nb) * SQ * H * D, ck = static_cast<size_t>(nb) * SK * HK * D;
    const size_t clse = static_cast<size_t>(nb) * H * SQ;

    // Tolerances: 16-bit outputs carry ~3 (bf16) or ~4 (fp16) significant digits.
    const double atol = o.bf16 ? 0.02 : 0.004, rtol = atol, lse_tol = o.bf16 ? 1e-2 : 2e-3;
    bool pass = true;
    auto check = [&](const char *name, const std::vector<float> &got, const std::vector<double> &want, size_t n,
                     bool is_lse) {
        const double err = max_abs_err(got, want, n), ref_max = max_abs(want, n);
        const double tol = is_lse ? lse_tol : atol + rtol * ref_max;
        const bool ok = err <= tol;
        pass = pass && ok;
        std::printf("  %-4s max abs err %.3e  (max |ref| %.3e, tol %.3e)  %s\n", name, err, ref_max, tol,
                    ok ? "ok" : "FAIL");
    };
    std::printf("check against the CPU reference (double):\n");
    check("out", widen(hout), ref.out, cq, false);
    check("lse", lse, ref.lse, clse, true);
    check("dq", widen(hdq), ref.dq, cq, false);
    check("dk", widen(hdk), ref.dk, ck, false);
    check("dv", widen(hdv), ref.dv, ck, false);

    if (!o.dump.empty()) {
        if (!little_endian()) std::fprintf(stderr, "mha_fwd_bwd: warning: host is big-endian, dump is not\n");
        std::error_code ec;
        std::filesystem::create_directories(o.dump, ec);
        write_file(o.dump, "q.bin", hq.data(), nq * 2);
        write_file(o.dump, "k.bin", hk.data(), nk * 2);
        write_file(o.dump, "v.bin", hv.data(), nk * 2);
        write_file(o.dump, "dout.bin", hdout.data(), nq * 2);
        write_file(o.dump, "out.bin", hout.data(), nq * 2);
        write_file(o.dump, "dq.bin", hdq.data(), nq * 2);
        write_file(o.dump, "dk.bin", hdk.data(), nk * 2);
        write_file(o.dump, "dv.bin", hdv.data(), nk * 2);
        write_file(o.dump, "lse.bin", lse.data(), nlse * sizeof(float));
        char meta[512];
        const int len = std::snprintf(meta, sizeof meta,
                                      "{\"batch\": %d, \"seqlen_q\": %d, \"seqlen_k\": %d, \"heads\": %d, "
                                      "\"heads_k\": %d, \"head_dim\": %d, \"dtype\": \"%s\", \"causal\": %s, "
                                      "\"softmax_scale\": %.9g}\n",
                                      B, SQ, SK, H, HK, D, dtype_name, o.causal ? "true" : "false",
                                      static_cast<double>(static_cast<float>(scale)));
        write_file(o.dump, "meta.json", meta, static_cast<size_t>(len));
        std::printf("dumped inputs and results to %s\n", o.dump.c_str());
    }

    // Timing: 3 warm-up calls, then --iters calls between two events on the same stream.
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
        cudaEvent_t start, stop;
        CUDA_CHECK(cudaEventCreate(&start));
        CUDA_CHECK(cudaEventCreate(&stop));
        auto time = [&](auto &&call) {
            for (int i = 0; i < 3; ++i) call();
            CUDA_CHECK(cudaEventRecord(start, stream));
            for (int i = 0; i < o.iters; ++i) call();
            CUDA_CHECK(cudaEventRecord(stop, stream));
            CUDA_CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
            return static_cast<double>(ms) / o.iters;
        };
        fwd_ms = time(forward);
        bwd_ms = time(backward);
        CUDA_CHECK(cudaGetLastError());
        std::printf("timing (%d iters): forward %.3f ms (%.1f TFLOP/s), backward %.3f ms (%.1f TFLOP/s)\n", o.iters,
                    fwd_ms, fwd_flops / (fwd_ms * 1e9), bwd_ms, bwd_flops / (bwd_ms * 1e9));
        CUDA_CHECK(cudaEventDestroy(start));
        CUDA_CHECK(cudaEventDestroy(stop));
    }

    CUDA_CHECK(cudaStreamDestroy(stream));
    for (void *p : {d_q, d_k, d_v, d_out, d_dout, d_dq, d_dk, d_dv, static_cast<void *>(d_lse), fwd_ws, bwd_ws})
        if (p) CUDA_CHECK(cudaFree(p));

    if (o.iters > 0)
        std::printf("mha_fwd_bwd: %s fwd %.3f ms (%.1f TFLOP/s) bwd %.3f ms (%.1f TFLOP/s)\n", pass ? "PASS" : "FAIL",
                    fwd_ms, fwd_flops / (fwd_ms * 1e9), bwd_ms, bwd_flops / (bwd_ms * 1e9));
    else
        std::printf("mha_fwd_bwd: %s (not timed)\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
