"""Decode configs and split counts on the GPU: which FWD_DECODE tile config and how many KV splits
read a long cache fastest, kernel time alone (CUDA-graph replay, so host overhead is out).

    python bench/decode_probe.py --out DIR [--configs all|table] [--layouts paged,contiguous]

Shapes as flashtile/bench_decode.py (seqlen_q 1, 32 query heads over 8 KV heads, head dim 128,
bf16, page 256), at cache sizes far past the 50 MB L2. Each (config, splits) is checked against
SDPA first. Prints, per point, the best few settings in GB/s of K and V read, and writes every
measurement to DIR/decode_probe.json.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtile.bench_decode import HEAD_DIM, NHEADS_K, decode_inputs, graph_time_ms, paged_copy  # noqa: E402

POINTS = ((1, 131072), (8, 32768), (8, 131072), (64, 8192), (128, 8192), (32, 65536))
SPLITS = (1, 2, 4, 8, 16, 32, 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default="all",
                        help="all (the candidates), table, or a list like 16x128w4s3,16x64w4s2")
    parser.add_argument("--layouts", default="paged,contiguous")
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--points", default=",".join(f"{b}x{n}" for b, n in POINTS),
                        help="batch x cache length pairs, e.g. 1x32768,64x8192")
    parser.add_argument("--splits", default=",".join(map(str, SPLITS)))
    parser.add_argument("--block-n", default="", help="only candidates with these block_n (e.g. 64,128)")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from flashtile import flash_attn_with_kvcache
    from flashtile.bench import warm_up_gpu
    from flashtile.configs import FWD_DECODE, PORTABLE_CANDIDATES, override, table_config

    args.out.mkdir(parents=True, exist_ok=True)
    table_cfg = table_config(FWD_DECODE, "sm90", HEAD_DIM, False, 2**20, torch.bfloat16)
    configs = [table_cfg] + [c for c in PORTABLE_CANDIDATES[FWD_DECODE][HEAD_DIM] if c != table_cfg]
    if args.configs == "table":
        configs = configs[:1]
    elif args.configs != "all":
        from flashtile.configs import KernelConfig

        configs = [KernelConfig(*map(int, re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", c).groups()))
                   for c in args.configs.split(",")]
    if args.block_n:
        configs = [c for c in configs if c.block_n in {int(n) for n in args.block_n.split(",")}]
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    split_counts = [int(x) for x in args.splits.split(",")]
    started = time.time()
    warm_up_gpu(2.0)
    records = []
    for batch, length in points:
        kv_bytes = 2 * batch * length * NHEADS_K * HEAD_DIM * 2
        q, k_cache, v_cache, seqlens, table = decode_inputs(torch, batch, length)
        with torch.no_grad():
            expected = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                                      v_cache.transpose(1, 2), enable_gqa=True).transpose(1, 2).float()
        for layout in args.layouts.split(","):
            if layout == "paged":
                kc, vc = paged_copy(torch, k_cache, v_cache, table)
                extra = dict(block_table=table)
            else:
                kc, vc, extra = k_cache, v_cache, {}
            for cfg in configs if layout == "paged" else configs[:1]:
                for splits in split_counts:
                    programs = batch * NHEADS_K * splits
                    if splits > 1 and (programs > 64 * 132 or length // splits < 256):
                        continue
                    if time.time() - started > args.budget_s:
                        break
                    rec = dict(batch=batch, cache=length, layout=layout, splits=splits, block_m=cfg.block_m,
                               block_n=cfg.block_n, warps=cfg.num_warps, stages=cfg.num_stages)

                    def call():
                        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits, **extra)
                    try:
                        with torch.no_grad(), override(fwd_decode=cfg):
                            got = call().float()
                            rec["rel_err"] = ((got - expected).norm() / expected.norm()).item()
                            ms = graph_time_ms(torch, call)
                        rec.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9, ok=rec["rel_err"] < 2e-2)
                    except Exception as exc:  # recorded, not fatal (e.g. out of shared memory)
                        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    records.append(rec)
            if layout == "paged":
                kc = vc = None
        q = k_cache = v_cache = None
        torch.cuda.empty_cache()
    (args.out / "decode_probe.json").write_text(json.dumps(records, indent=1) + "\n")
    errors = [r for r in records if "error" in r]
    print(f"{len(records)} settings, {len(errors)} errors, {sum(1 for r in records if r.get('ok') is False)} wrong")
    for r in errors[:5]:
        print("  error:", r)
    for batch, length in points:
        for layout in args.layouts.split(","):
            rows = sorted((r for r in records if (r["batch"], r["cache"], r["layout"]) == (batch, length, layout)
                           and r.get("ok")), key=lambda r: -r["gbps"])
            best = ", ".join(f"{r['block_n']}w{r['warps']}s{r['stages']}/sp{r['splits']}={r['gbps']:.0f}"
                             for r in rows[:4])
            print(f"b={batch:<4} cache={length:<7} {layout:<10} {best}")
    # Per config: geometric mean over the paged points of its best split count.
    by_cfg = {}
    for r in records:
        if r.get("ok") and r["layout"] == "paged":
            key = (r["block_n"], r["warps"], r["stages"])
            point = (r["batch"], r["cache"])
            by_cfg.setdefault(key, {})
            by_cfg[key][point] = max(by_cfg[key].get(point, 0), r["gbps"])
    import math
    print("config (block_n, warps, stages): geomean of best-split GB/s over paged points")
    for key, pts in sorted(by_cfg.items(), key=lambda kv: -sum(map(math.log, kv[1].values())) / len(kv[1])):
        print(f"  {key}: {math.exp(sum(map(math.log, pts.values())) / len(pts)):.0f} over {len(pts)} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
