// example_common.hpp: the generic helpers that the C API examples share (mha_fwd_bwd.cpp,
// varlen_inference.cpp). Nothing here makes a flashtile attention call: the calls, and the filling
// of their argument structs, stay in the examples so that each reads top to bottom as an example of
// the API.
// The helpers live in namespace ex, so `ex::` marks what comes from this file.

#pragma once

#include <cuda_runtime.h>

#include "flashtile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Error handling: every failure ends the program with a message and exit status 1. Macros, so
// that the message names the file, line and call that failed.

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

namespace ex {

// ---------------------------------------------------------------------------------------------
// 16-bit floating point on the host (round to nearest even, like the GPU's conversions). The
// examples pass bf16 / fp16 tensors to flashtile and need the same bits on the host.

inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);  // ties go to the even upper half
    return static_cast<uint16_t>(x >> 16);
}

inline float bf16_to_float(uint16_t h) {
    uint32_t x = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}

inline uint16_t float_to_fp16(float f) {
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

inline float fp16_to_float(uint16_t h) {
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

// The 16-bit type that --dtype picked: its name and its host conversions.
struct Dtype16 {
    bool bf16;
    const char *name() const { return bf16 ? "bf16" : "fp16"; }
    uint16_t from_float(float f) const { return bf16 ? float_to_bf16(f) : float_to_fp16(f); }
    float to_float(uint16_t h) const { return bf16 ? bf16_to_float(h) : fp16_to_float(h); }
};

// Random inputs: normal values rounded to the 16-bit type. `bits` go to the GPU and `vals` (the
// same rounded values, widened) to the CPU reference, so the reference sees exactly what the GPU
// sees. One generator serves all tensors, in the order they are drawn.
struct Rounded16 {
    std::vector<uint16_t> bits;
    std::vector<double> vals;
};

class RandomRounded {
  public:
    RandomRounded(unsigned seed, Dtype16 dtype) : rng_(seed), dtype_(dtype) {}
    Rounded16 operator()(size_t n) {
        Rounded16 t;
        t.bits.resize(n);
        t.vals.resize(n);
        for (size_t i = 0; i < n; ++i) {
            t.bits[i] = dtype_.from_float(normal_(rng_));
            t.vals[i] = dtype_.to_float(t.bits[i]);
        }
        return t;
    }

  private:
    std::mt19937 rng_;
    std::normal_distribution<float> normal_{0.0f, 1.0f};
    Dtype16 dtype_;
};

// ---------------------------------------------------------------------------------------------
// Command line. Both examples read "--opt value" or "--opt=value"; a bad value or an unknown
// option prints a message and the usage and exits with status 1, -h / --help prints the usage
// and exits with status 0.

[[noreturn]] inline void usage_exit(const char *program, const char *usage, const char *msg) {
    if (msg) std::fprintf(stderr, "%s: %s\n", program, msg);
    std::fprintf(stderr, "%s", usage);
    std::exit(msg ? 1 : 0);
}

// Walks argv one option at a time: next() steps on, name() is the option without any "=value",
// value() its value (after '=' or the next argument).
class ArgReader {
  public:
    ArgReader(int argc, char **argv, const char *program, const char *usage)
        : argc_(argc), argv_(argv), program_(program), usage_(usage) {}

    bool next() {
        if (++i_ >= argc_) return false;
        name_ = argv_[i_];
        value_.clear();
        has_eq_ = name_.find('=') != std::string::npos;
        if (has_eq_) {
            value_ = name_.substr(name_.find('=') + 1);
            name_ = name_.substr(0, name_.find('='));
        }
        return true;
    }
    const std::string &name() const { return name_; }
    bool is(const char *opt) const { return name_ == opt; }
    bool is_flag(const char *opt) const { return !has_eq_ && name_ == opt; }  // an option without a value

    std::string value() {
        if (has_eq_) return value_;
        if (i_ + 1 >= argc_) usage(("missing value for " + name_).c_str());
        return argv_[++i_];
    }
    int int_value(long lo) { return to_int(name_, value(), lo); }
    // `text` as an int in [lo, INT_MAX]; anything else is a usage error that names `what`.
    int to_int(const std::string &what, const std::string &text, long lo) const {
        char *end = nullptr;
        const long v = std::strtol(text.c_str(), &end, 10);
        if (text.empty() || *end != '\0' || v < lo || v > std::numeric_limits<int>::max())
            usage(("bad value for " + what + ": '" + text + "'").c_str());
        return static_cast<int>(v);
    }

    [[noreturn]] void usage(const char *msg) const { usage_exit(program_, usage_, msg); }
    // For an argument that no option took: -h / --help, or an error.
    [[noreturn]] void unknown() const {
        if (name_ == "-h" || name_ == "--help") usage(nullptr);
        usage(("unknown option " + name_).c_str());
    }

  private:
    int argc_;
    char **argv_;
    const char *program_, *usage_;
    int i_ = 0;
    std::string name_, value_;
    bool has_eq_ = false;
};

// The options both examples take; each example's Options derives from this with its own defaults.
// heads_k -1 stands for as many as heads.
struct CommonOptions {
    CommonOptions(int heads_, int heads_k_, int head_dim_, bool causal_)
        : heads(heads_), heads_k(heads_k_), head_dim(head_dim_), causal(causal_) {}
    int heads, heads_k, head_dim;
    bool bf16 = true, causal;
    int iters = 20;
    unsigned seed = 0;
    std::string dump;
};

// Reads the current argument if it is one of the common options; false if it is not.
inline bool read_common_option(ArgReader &a, CommonOptions &o) {
    if (a.is("--heads")) o.heads = a.int_value(1);
    else if (a.is("--heads-k")) o.heads_k = a.int_value(1);
    else if (a.is("--head-dim")) o.head_dim = a.int_value(1);
    else if (a.is("--iters")) o.iters = a.int_value(0);
    else if (a.is("--seed")) o.seed = static_cast<unsigned>(a.int_value(0));
    else if (a.is("--dump")) o.dump = a.value();
    else if (a.is_flag("--causal")) o.causal = true;
    else if (a.is("--dtype")) {
        const std::string d = a.value();
        if (d == "bf16" || d == "bfloat16") o.bf16 = true;
        else if (d == "fp16" || d == "float16") o.bf16 = false;
        else a.usage(("bad --dtype '" + d + "' (bf16 or fp16)").c_str());
    } else return false;
    return true;
}

// After the last option: fills in heads_k -1 and checks that the heads form groups.
inline void check_common_options(const ArgReader &a, CommonOptions &o) {
    if (o.heads_k < 0) o.heads_k = o.heads;
    if (o.heads % o.heads_k != 0) a.usage("--heads must be a multiple of --heads-k");
}

// ---------------------------------------------------------------------------------------------
// CPU reference in double, the part both examples need: the forward of one query row.

// Query row q_row against keys 0 .. nvis-1 (k_row(j), v_row(j): key j's and value j's head_dim
// values; nvis >= 1). Adds the output to out_row, leaves the probabilities in p[0 .. nvis-1] and
// returns the row's log-sum-exp.
template <class KRow, class VRow>
double attention_row(const double *q_row, int nvis, int d, double scale, KRow k_row, VRow v_row,
                     std::vector<double> &p, double *out_row) {
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < nvis; ++j) {
        const double *kj = k_row(j);
        double dot = 0;
        for (int x = 0; x < d; ++x) dot += q_row[x] * kj[x];
        p[j] = dot * scale;
        m = std::max(m, p[j]);
    }
    double sum = 0;
    for (int j = 0; j < nvis; ++j) sum += (p[j] = std::exp(p[j] - m));
    for (int j = 0; j < nvis; ++j) {
        p[j] /= sum;
        const double *vj = v_row(j);
        for (int x = 0; x < d; ++x) out_row[x] += p[j] * vj[x];
    }
    return m + std::log(sum);
}

// ---------------------------------------------------------------------------------------------
// Checking results: the same tolerances and report line in both examples.

// 16-bit outputs carry ~3 (bf16) or ~4 (fp16) significant digits; lse is float32 but computed
// from 16-bit inputs.
struct Tolerances {
    double atol, rtol, lse;
};
inline Tolerances tolerances(bool bf16) {
    const double atol = bf16 ? 0.02 : 0.004;
    return {atol, atol, bf16 ? 1e-2 : 2e-3};
}

// |got - want|, where a NaN or inf from the library counts as inf.
inline double abs_err(float got, double want) { return std::isfinite(got) ? std::fabs(got - want) : INFINITY; }

// Prints one line of the check and returns whether it passed.
inline bool report_check(const char *name, double err, double ref_max, double tol) {
    const bool ok = err <= tol;
    std::printf("  %-4s max abs err %.3e  (max |ref| %.3e, tol %.3e)  %s\n", name, err, ref_max, tol,
                ok ? "ok" : "FAIL");
    return ok;
}

// ---------------------------------------------------------------------------------------------
// Device memory. Zero bytes allocate nothing (a workspace may be empty), and null is not freed.

inline void *device_alloc(size_t bytes) {
    void *p = nullptr;
    if (bytes) CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
}

inline void device_free_all(std::initializer_list<void *> ptrs) {
    for (void *p : ptrs)
        if (p) CUDA_CHECK(cudaFree(p));
}

// ---------------------------------------------------------------------------------------------
// Timing with CUDA events: 3 warm-up calls, then `iters` calls between two events on the stream.

class EventTimer {
  public:
    explicit EventTimer(cudaStream_t stream) : stream_(stream) {
        CUDA_CHECK(cudaEventCreate(&start_));
        CUDA_CHECK(cudaEventCreate(&stop_));
    }
    ~EventTimer() {
        CUDA_CHECK(cudaEventDestroy(start_));
        CUDA_CHECK(cudaEventDestroy(stop_));
    }
    EventTimer(const EventTimer &) = delete;
    EventTimer &operator=(const EventTimer &) = delete;

    // Milliseconds per call, iters >= 1.
    template <class Call>
    double ms_per_call(int iters, Call &&call) {
        for (int i = 0; i < 3; ++i) call();
        CUDA_CHECK(cudaEventRecord(start_, stream_));
        for (int i = 0; i < iters; ++i) call();
        CUDA_CHECK(cudaEventRecord(stop_, stream_));
        CUDA_CHECK(cudaEventSynchronize(stop_));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
        return static_cast<double>(ms) / iters;
    }

  private:
    cudaStream_t stream_;
    cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// --dump DIR: inputs and results as raw binaries plus meta.json, so that a Python script can
// compare them with flashtile's Python API. The binaries are in host byte order, which the script
// takes for little-endian.

inline bool little_endian() {
    const uint16_t one = 1;
    unsigned char c;
    std::memcpy(&c, &one, 1);
    return c == 1;
}

// One file of the dump: a vector's bytes or a string's characters.
struct DumpFile {
    template <class T>
    DumpFile(const char *name_, const std::vector<T> &v) : name(name_), data(v.data()), bytes(v.size() * sizeof(T)) {}
    DumpFile(const char *name_, const std::string &s) : name(name_), data(s.data()), bytes(s.size()) {}
    const char *name;
    const void *data;
    size_t bytes;
};

// Writes `files` into dir (created if need be), in order; a file that cannot be written ends the
// program.
inline void write_dump(const char *program, const std::string &dir, std::initializer_list<DumpFile> files) {
    if (!little_endian()) std::fprintf(stderr, "%s: warning: host is big-endian, dump is not\n", program);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    for (const DumpFile &file : files) {
        const std::string path = dir + "/" + file.name;
        FILE *f = std::fopen(path.c_str(), "wb");
        if (!f || std::fwrite(file.data, 1, file.bytes, f) != file.bytes || std::fclose(f) != 0) {
            std::fprintf(stderr, "%s: cannot write %s\n", program, path.c_str());
            std::exit(1);
        }
    }
    std::printf("dumped inputs and results to %s\n", dir.c_str());
}

// meta.json: the shape of the call as its arguments give it, the dtype's name and the softmax
// scale (as the float the GPU uses); `extra` appends fields of one example (", \"name\": value").
inline std::string meta_json(const flashtile_attention_args &args, const char *dtype, double scale,
                             const std::string &extra = "") {
    char scale_text[32];
    std::snprintf(scale_text, sizeof scale_text, "%.9g", static_cast<double>(static_cast<float>(scale)));
    return "{\"batch\": " + std::to_string(args.batch) + ", \"seqlen_q\": " + std::to_string(args.seqlen_q) +
           ", \"seqlen_k\": " + std::to_string(args.seqlen_k) + ", \"heads\": " + std::to_string(args.nheads) +
           ", \"heads_k\": " + std::to_string(args.nheads_k) + ", \"head_dim\": " + std::to_string(args.head_dim) +
           ", \"dtype\": \"" + dtype + "\", \"causal\": " + (args.causal ? "true" : "false") +
           ", \"softmax_scale\": " + scale_text + extra + "}\n";
}

}  // namespace ex
