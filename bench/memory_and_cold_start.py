"""Two facts a user asks before adopting an attention library, measured on the GPU.

    python bench/memory_and_cold_start.py --out bench/results/<dir>

1. Memory at long context: forward + backward at seqlen 131072 (batch 1, 16 heads,
   head dim 128, bf16, causal). The peak allocated memory during the call, minus what
   was allocated before it, against the bytes of what must exist anyway: inputs q, k, v,
   the incoming gradient dout, the output, dq, dk, dv and the float32 lse.
2. Cold start: the first call of a common shape (batch 4, seqlen 4096, 16 heads, head dim
   128, bf16, causal) in a fresh process with an empty Triton cache (every kernel compiles),
   then the same in a second process with the cache warm (kernels load from disk), then a
   warm call in-process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def memory_check(deterministic: bool) -> dict:
    import torch

    from flashtile import flash_attn_func

    b, s, h, d = 1, 131072, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before
    tensor_bytes = b * s * h * d * 2
    # Created by the call and needed by any implementation: out, dq, dk, dv and lse.
    required = 4 * tensor_bytes + b * h * s * 4
    return {"deterministic": deterministic, "seqlen": s, "peak_extra_bytes": peak, "required_bytes": required,
            "overhead_pct": 100.0 * (peak - required) / required,
            "inputs_bytes": 4 * tensor_bytes, "seconds": seconds,
            "finite": bool(torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all())}


def first_call() -> dict:
    import torch

    from flashtile import flash_attn_func

    b, s, h, d = 4, 4096, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    timings = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return {"first_s": timings[0], "second_s": timings[1], "third_s": timings[2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--child", choices=("first_call",))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(first_call()))
        return 0
    import torch

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    result["memory"] = [memory_check(deterministic=False), memory_check(deterministic=True)]
    cache = tempfile.mkdtemp(prefix="flashtile-cold-")
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    for label in ("empty_cache", "warm_disk_cache"):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--child", "first_call"],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            result[label] = {"error": proc.stderr[-2000:]}
            continue
        result[label] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                         "process_s": time.perf_counter() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_and_cold_start.json").write_text(json.dumps(result, indent=1))
    for m in result["memory"]:
        print(f"seqlen {m['seqlen']} causal fwd+bwd deterministic={m['deterministic']}: peak extra "
              f"{m['peak_extra_bytes'] / 2**20:.0f} MiB vs out+grads+lse {m['required_bytes'] / 2**20:.0f} MiB "
              f"({m['overhead_pct']:+.1f}%), {m['seconds']:.2f} s, finite={m['finite']}")
    for label in ("empty_cache", "warm_disk_cache"):
        r = result[label]
        if "error" in r:
            print(label, "ERROR", r["error"][-300:])
        else:
            print(f"{label}: first fwd+bwd call {r['first_s']:.2f} s, second {r['second_s'] * 1e3:.1f} ms, "
                  f"third {r['third_s'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
