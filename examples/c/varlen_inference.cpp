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
    std::vector<int> lengths = {1, 113, 1023, 4096, 517};
    int heads = 32, heads_k = 8, head_dim = 128;
    bool bf16 = true, causal = true;
    int iters = 20;
    unsigned seed = 0;
    std::string dump;
};

[[noreturn]] void usage(const char *msg) {
    if (msg) std::fprintf(stderr, "varlen_inference: %s\n", msg);
    std::fprintf(stderr,
                 "usage: varlen_inference [--lengths L1,L2,...] [--heads N] [--heads-k N] [--head-dim N]\n"
                 "                        [--dtype bf16|fp16] [--causal | --no-causal] [--iters N] [--seed N]\n"
                 "                        [--dump DIR]\n");
    std::exit(msg ? 1 : 0);
}

long parse_int(const std::string &name, const std::string &text, long lo) {
    char *end = nullptr;
    const long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || v < lo || v > std::numeric_limits<int>::max())
        usage(("bad value for " + name + ": '" + text + "'").c_str());
    return v;
}

std::vector<int> parse_lengths(const std::string &text) {
    std::vector<int> out;
    size_t pos = 0;
    while (pos <= text.size()) {
        const size_t comma = std::min(text.find(',', pos), text.size());
        out.push_back(static_cast<int>(parse_int("--lengths", text.substr(pos, comma - pos), 0)));
        pos = comma + 1;
    }
    return out;
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
        if (arg == "--lengths") o.lengths = parse_lengths(next());
        else if (arg == "--heads") o.heads = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--heads-k") o.heads_k = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--head-dim") o.head_dim = static_cast<int>(parse_int(arg, next(), 1));
        else if (arg == "--iters") o.iters = static_cast<int>(parse_int(arg, next(), 0));
        else if (arg == "--seed") o.seed = static_cast<unsigned>(parse_int(arg, next(), 0));
        else if (arg == "--dump") o.dump = next();
        else if (arg == "--causal" && !has_eq) o.causal = true;
        else if (arg == "--no-causal" && !has_eq) o.causal = false;
        else if (arg == "--dtype") {
            const std::string d = next();
            if (d == "bf16" || d == "bfloat16") o.bf16 = true;
            else if (d == "fp16" || d == "float16") o.bf16 = false;
            else usage(("bad --dtype '" + d + "' (bf16 or fp16)").c_str());
        } else if (arg == "-h" || arg == "--help") usage(nullptr);
        else usage(("unknown option " + arg).c_str());
    }
    if (o.heads % o.heads_k != 0) usage("--heads must be a multiple of --heads-k");
    long long total = 0;
    for (int len : o.lengths) total += len;
    if (total == 0 || total > std::numeric_limits<int32_t>::max()) usage("--lengths must add up to 1 .. 2^31-1 rows");
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
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < nvis; ++j) {
        const double *kj = &k[koff(j)];
        double dot = 0;
        for (int x = 0; x < D; ++x) dot += qi[x] * kj[x];
        p[j] = dot * scale;
        m = std::max(m, p[j]);
    }
    double sum = 0;
    for (int j = 0; j < nvis; ++j) sum += (p[j] = std::exp(p[j] - m));
    *lse = m + std::log(sum);
    std::fill(out_row, out_row + D, 0.0);
    for (int j = 0; j < nvis; ++j) {
        const double w = p[j] / sum, *vj = &v[koff(j)];
        for (int x = 0; x < D; ++x) out_row[x] += w * vj[x];
    }
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
        std::fprintf(stderr, "varlen_inference: cannot write %s\n", path.c_str());
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
    const int H = o.heads, HK = o.heads_k, D = o.head_dim, nseq = static_cast<int>(o.lengths.size());
    const char *dtype_name = o.bf16 ? "bf16" : "fp16";
    auto to16 = o.bf16 ? float_to_bf16 : float_to_fp16;
    auto from16 = o.bf16 ? bf16_to_float : fp16_to_float;
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
                nseq, lengths_text.c_str(), total, max_len, H, HK, D, dtype_name, o.causal ? " causal" : "");
    std::printf("flashtile: %s\n", flashtile_build_info());

    const size_t nq = static_cast<size_t>(total) * H * D, nk = static_cast<size_t>(total) * HK * D;
    const size_t nlse = static_cast<size_t>(H) * total;

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
    std::vector<uint16_t> hq, hk, hv;
    std::vector<double> q, k, v;
    make(nq, hq, q);
    make(nk, hk, k);
    make(nk, hv, v);

    // Device buffers. Outputs start as all-ones bytes (NaN in every type) so unwritten values show.
    CUDA_CHECK(cudaSetDevice(0));
    void *d_q = device_alloc(nq * 2), *d_k = device_alloc(nk * 2), *d_v = device_alloc(nk * 2);
    void *d_out = device_alloc(nq * 2);
    float *d_lse = static_cast<float *>(device_alloc(nlse * sizeof(float)));
    int32_t *d_cu = static_cast<int32_t *>(device_alloc(cu_seqlens.size() * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(d_q, hq.data(), nq * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_v, hv.data(), nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_cu, cu_seqlens.data(), cu_seqlens.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0xff, nq * 2));
    CUDA_CHECK(cudaMemset(d_lse, 0xff, nlse * sizeof(float)));

    // Packed tensors: rows counted over the whole batch, so batch_stride is unused (0).
    flashtile_attention_args args;
    flashtile_attention_args_init(&args);
    args.dtype = o.bf16 ? FLASHTILE_BFLOAT16 : FLASHTILE_FLOAT16;
    args.batch = nseq;
    args.seqlen_q = total;  // packed: total rows
    args.seqlen_k = total;
    args.nheads = H;
    args.nheads_k = HK;
    args.head_dim = D;
    args.q = {d_q, 0, static_cast<int64_t>(H) * D, D};
    args.k = {d_k, 0, static_cast<int64_t>(HK) * D, D};
    args.v = {d_v, 0, static_cast<int64_t>(HK) * D, D};
    args.out = {d_out, 0, static_cast<int64_t>(H) * D, D};
    args.softmax_lse = d_lse;  // (heads, total) float32
    args.causal = o.causal ? 1 : 0;
    args.cu_seqlens_q = d_cu;  // queries and keys share the lengths here
    args.cu_seqlens_k = d_cu;
    args.max_seqlen_q = max_len;
    args.max_seqlen_k = max_len;

    size_t ws_bytes = 0;
    FT_CHECK(flashtile_attention_forward_workspace_size(&args, &ws_bytes));
    void *ws = device_alloc(ws_bytes);
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

    const double atol = o.bf16 ? 0.02 : 0.004, rtol = atol, lse_tol = o.bf16 ? 1e-2 : 2e-3;
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
                reference_row(q, k, v, H, HK, D, start, len, i, h, o.causal, scale, p, ref_out.data(), &ref_lse);
                const uint16_t *got = &hout[(static_cast<size_t>(start + i) * H + h) * D];
                for (int x = 0; x < D; ++x) {
                    const float g = from16(got[x]);
                    out_err = std::max(out_err, std::isfinite(g) ? std::fabs(g - ref_out[x]) : INFINITY);
                    out_ref_max = std::max(out_ref_max, std::fabs(ref_out[x]));
                }
                const float gl = lse[static_cast<size_t>(h) * total + start + i];
                lse_err = std::max(lse_err, std::isfinite(gl) ? std::fabs(gl - ref_lse) : INFINITY);
            }
        }
    }
    // Rows the reference skipped must still have been written (no NaN / inf left over).
    for (uint16_t b : hout) nonfinite += !std::isfinite(from16(b));
    for (float l : lse) nonfinite += !std::isfinite(l);

    const double out_tol = atol + rtol * out_ref_max;
    const bool out_ok = out_err <= out_tol, lse_ok = lse_err <= lse_tol, finite_ok = nonfinite == 0;
    const bool pass = out_ok && lse_ok && finite_ok;
    std::printf("check against the CPU reference (double), %zu of %d query rows x %d heads:\n", rows_checked, total,
                H);
    std::printf("  out  max abs err %.3e  (max |ref| %.3e, tol %.3e)  %s\n", out_err, out_ref_max, out_tol,
                out_ok ? "ok" : "FAIL");
    std::printf("  lse  max abs err %.3e  (tol %.3e)  %s\n", lse_err, lse_tol, lse_ok ? "ok" : "FAIL");
    std::printf("  all out / lse values finite: %s (%zu not)\n", finite_ok ? "ok" : "FAIL", nonfinite);

    if (!o.dump.empty()) {
        if (!little_endian()) std::fprintf(stderr, "varlen_inference: warning: host is big-endian, dump is not\n");
        std::error_code ec;
        std::filesystem::create_directories(o.dump, ec);
        write_file(o.dump, "q.bin", hq.data(), nq * 2);
        write_file(o.dump, "k.bin", hk.data(), nk * 2);
        write_file(o.dump, "v.bin", hv.data(), nk * 2);
        write_file(o.dump, "out.bin", hout.data(), nq * 2);
        write_file(o.dump, "lse.bin", lse.data(), nlse * sizeof(float));
        // seqlen_q / seqlen_k are the packed totals, as in the call's arguments.
        const std::string meta =
            "{\"batch\": " + std::to_string(nseq) + ", \"seqlen_q\": " + std::to_string(total) +
            ", \"seqlen_k\": " + std::to_string(total) + ", \"heads\": " + std::to_string(H) +
            ", \"heads_k\": " + std::to_string(HK) + ", \"head_dim\": " + std::to_string(D) + ", \"dtype\": \"" +
            dtype_name + "\", \"causal\": " + (o.causal ? "true" : "false") + ", \"softmax_scale\": " + [&] {
                char buf[32];
                std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(static_cast<float>(scale)));
                return std::string(buf);
            }() + ", \"lengths\": [" + lengths_text + "]}\n";
        write_file(o.dump, "meta.json", meta.data(), meta.size());
        std::printf("dumped inputs and results to %s\n", o.dump.c_str());
    }

    // Timing: 3 warm-up calls, then --iters calls between two events on the same stream. FLOPs:
    // two matmuls of 2*len*len*d per sequence and head, half of that when causal.
    double flops = 0;
    for (int len : o.lengths) flops += 4.0 * H * len * len * D * (o.causal ? 0.5 : 1.0);
    double ms = 0;
    if (o.iters > 0) {
        cudaEvent_t start, stop;
        CUDA_CHECK(cudaEventCreate(&start));
        CUDA_CHECK(cudaEventCreate(&stop));
        for (int i = 0; i < 3; ++i) forward();
        CUDA_CHECK(cudaEventRecord(start, stream));
        for (int i = 0; i < o.iters; ++i) forward();
        CUDA_CHECK(cudaEventRecord(stop, stream));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float total_ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&total_ms, start, stop));
        ms = static_cast<double>(total_ms) / o.iters;
        std::printf("timing (%d iters): forward %.3f ms (%.1f TFLOP/s)\n", o.iters, ms, flops / (ms * 1e9));
        CUDA_CHECK(cudaEventDestroy(start));
        CUDA_CHECK(cudaEventDestroy(stop));
    }

    CUDA_CHECK(cudaStreamDestroy(stream));
    for (void *ptr : {d_q, d_k, d_v, d_out, static_cast<void *>(d_lse), static_cast<void *>(d_cu), ws})
        if (ptr) CUDA_CHECK(cudaFree(ptr));

    if (o.iters > 0)
        std::printf("varlen_inference: %s fwd %.3f ms (%.1f TFLOP/s)\n", pass ? "PASS" : "FAIL", ms,
                    flops / (ms * 1e9));
    else
        std::printf("varlen_inference: %s (not timed)\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
}
