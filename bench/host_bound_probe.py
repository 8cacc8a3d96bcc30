"""How much of a short sweep point is host time: each system timed as the sweep times it
(do_bench: L2 flushed, the call's host time inside the measured span once the flush has
drained) and from a CUDA graph replay of the same call (no host time, L2 still flushed).

    PYTHONPATH=<repo> python bench/host_bound_probe.py [--headdims 64,128,256] [--seqlens 1024,2048,4096]
        [--systems flashtile,sdpa-cudnn] [--modes fwd,bwd] [--out DIR]

The gap between the two columns is what a lower host cost per call could win at that point.
"""

import argparse
import gc
import json
import os

import torch
import triton

from flashtile import bench


def graph_ms(make_fn, reps: int = 50) -> float:
    """Median milliseconds of a CUDA graph replay of ``make_fn()``, L2 flushed before each replay.
    The function is built on the capturing stream: a timed backward runs on the stream of its
    forward, which must not be the legacy default stream during capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = make_fn()
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdims", default="64,128,256")
    ap.add_argument("--seqlens", default="1024,2048,4096")
    ap.add_argument("--systems", default="flashtile,sdpa-cudnn")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-gc", action="store_true", help="gc.disable() (is Python's collector in the host time?)")
    args = ap.parse_args()
    if args.no_gc:
        gc.disable()
    headdims = [int(x) for x in args.headdims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    systems, modes = args.systems.split(","), args.modes.split(",")
    bench.warm_up_gpu(2.0)
    rows = []
    for config in bench.sweep_configs(headdims, seqlens, (False, True), 16384, 2048):
        inputs = bench.make_inputs(config, "bf16", "cuda")
        for mode in modes:
            row = dict(headdim=config.headdim, causal=config.causal, seqlen=config.seqlen, mode=mode)
            for system in systems:
                with bench.SYSTEMS[system](config, "cuda") as attn:
                    fn = bench.timed_callable(attn, inputs, mode)
                    eager = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
                    replay = graph_ms(lambda: bench.timed_callable(attn, inputs, mode))
                flop = bench.flops(config, mode)
                row[system] = dict(eager_ms=eager, graph_ms=replay, eager_tflops=flop / eager * 1e-9,
                                   graph_tflops=flop / replay * 1e-9)
            rows.append(row)
            cells = "  ".join(f"{s}: {row[s]['eager_tflops']:6.1f} / {row[s]['graph_tflops']:6.1f}" for s in systems)
            print(f"d{config.headdim:<4}{'causal' if config.causal else 'full':<7}{config.seqlen:>6} {mode:<4} "
                  f"{cells}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_bound_probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), f, indent=1)
    if "flashtile" in systems and "sdpa-cudnn" in systems:
        print("\nflashtile / cudnn: eager (do_bench, as the sweep) -> graph replay (no host time)")
        for row in rows:
            ft, cd = row["flashtile"], row["sdpa-cudnn"]
            print(f"  d{row['headdim']:<4}{'causal' if row['causal'] else 'full':<7}{row['seqlen']:>6} {row['mode']:<4}"
                  f" {ft['eager_tflops'] / cd['eager_tflops']:.2f} -> {ft['graph_tflops'] / cd['graph_tflops']:.2f}"
                  f"   (flashtile eager {ft['eager_ms'] * 1e3:7.1f} us, graph {ft['graph_ms'] * 1e3:7.1f} us)")


if __name__ == "__main__":
    main()
