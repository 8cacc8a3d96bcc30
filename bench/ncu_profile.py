"""Profile one flashtile attention kernel under Nsight Compute and summarize where its warps wait.

    PYTHONPATH=<repo> python bench/ncu_profile.py --mode bwd --head-dim 128 --seqlen 4096 --out $OUT

Runs itself under ``ncu`` (one launch of the kernel matching --kernel, after the warm-up calls),
then prints from the report: the speed-of-light and pipe utilization lines, the warp-state
breakdown, and the SASS instructions with the most stall samples (what each waits on). The full
report (.ncu-rep) and the text pages stay under --out. Clocks are left alone (--clock-control
none). The shapes are the sweep's: 16k tokens per batch, hidden 2048, bf16.
"""

import argparse
import csv
import io
import math
import os
import subprocess
import sys

KERNELS = {"fwd": "gluon_attn_fwd_kernel", "bwd": "gluon_attn_bwd"}
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats", "InstructionStats",
            "SourceCounters", "Occupancy"]


def run_target(args):
    """The profiled program: a few calls of the op (compile, warm up), the profiled one last."""
    import torch
    from flashtile import flash_attn_func

    d, s = args.head_dim, args.seqlen
    b, h = max(16384 // s, 1), 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    for _ in range(3):
        out = flash_attn_func(q, k, v, causal=args.causal, softmax_scale=scale)
        if args.mode == "bwd":
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()


def top_stalls(source_csv: str, n: int) -> str:
    rows = list(csv.reader(io.StringIO(source_csv)))
    head = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
    cols, body = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    src = cols.index("Source")
    samples = next(i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All"))
    reason_cols = [i for i, c in enumerate(cols) if c.startswith("stall_") or c.startswith("smsp__pcsamp")]

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[samples]) for r in body) or 1.0
    lines = [f"{len(body)} SASS lines, {total:.0f} stall samples; top {n}:"]
    for r in sorted(body, key=lambda r: -num(r[samples]))[:n]:
        reasons = sorted(((num(r[i]), cols[i]) for i in reason_cols), reverse=True)[:2]
        why = ", ".join(f"{c}={v:.0f}" for v, c in reasons if v > 0)
        lines.append(f"{100 * num(r[samples]) / total:5.1f}%  {r[src].strip()[:70]:70s} {why}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kernel", default=None, help="kernel name regex (default: the Gluon kernel of --mode)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.target:
        return run_target(args)

    tag = f"{args.mode}_d{args.head_dim}_s{args.seqlen}{'_causal' if args.causal else ''}"
    rep = os.path.join(args.out, tag)
    kernel = args.kernel or KERNELS[args.mode]
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", f"regex:{kernel}", "--launch-skip", "2",
           "--launch-count", "1", "--import-source", "no", "-f", "-o", rep]
    for sec in SECTIONS:
        cmd += ["--section", sec]
    # The warp-state breakdown and tensor-pipe use as numbers (the sections show them as charts).
    cmd += ["--metrics", "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,"
                         "regex:sm__pipe_tensor_op.*cycles_active\\.avg\\.pct_of_peak_sustained_active"]
    cmd += [sys.executable, os.path.abspath(__file__), "--target", "--mode", args.mode, "--head-dim",
            str(args.head_dim), "--seqlen", str(args.seqlen)] + (["--causal"] if args.causal else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"ncu failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    details = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "details"], capture_output=True,
                             text=True).stdout
    source = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                            capture_output=True, text=True).stdout
    with open(rep + "_details.txt", "w") as f:
        f.write(details)
    with open(rep + "_source.csv", "w") as f:
        f.write(source)
    keep = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "Executed Ipc", "Issue Slots Busy",
            "Issued Warp Per Scheduler", "No Eligible", "Active Warps Per Scheduler", "Eligible Warps",
            "Warp Cycles Per Issued", "Registers Per Thread", "Dynamic Shared", "Achieved Occupancy")
    print(f"== {tag}: {kernel}")
    for line in details.splitlines():
        if any(k in line for k in keep) or "stalled" in line or "pipe_tensor" in line:
            print(line.rstrip())
    try:
        print(top_stalls(source, args.top))
    except (StopIteration, ValueError) as e:
        print(f"(no source page: {e}); header: {source[:600]}")


if __name__ == "__main__":
    main()
