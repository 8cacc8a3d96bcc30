"""flashtile's main job, end to end: run the kernels, check them against the float64
reference, and (on a GPU) time them next to PyTorch's SDPA.

    python demo.py            # on a CUDA GPU: compiled kernels, bf16, plus timings
    python demo.py            # without CUDA: the same kernels through Triton's CPU interpreter

Each row runs forward and backward and prints the relative error of out, dq, dk, dv
against float64, next to the error PyTorch itself makes in the same dtype.
"""

import os
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Must be set before triton is imported (flashtile imports it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

from flashtile import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashtile.reference import attention_varlen_naive  # noqa: E402
from flashtile.testing import allowed_error, reference_errors  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16

# (label, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, options)
CHECKS = [
    ("plain", 2, 128, 128, 4, 4, 64, {}),
    ("causal, sq != sk", 2, 113, 200, 4, 4, 64, {"causal": True}),
    ("GQA 8:2, causal", 2, 128, 128, 8, 2, 128, {"causal": True}),
    ("sliding window (32, 0)", 1, 200, 200, 4, 4, 96, {"window_size": (32, 0)}),
    ("softcap 30 + ALiBi", 2, 96, 96, 4, 4, 40, {"softcap": 30.0, "alibi": True}),
    ("head dim 200", 1, 64, 64, 2, 2, 200, {"causal": True}),
]
if ON_GPU:  # bigger shapes where they are cheap
    CHECKS = [(label, b, sq * 8, sk * 8, h, hk, d, opts) for label, b, sq, sk, h, hk, d, opts in CHECKS]


def run_check(label, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, options):
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(nheads, device=DEVICE) * 0.1
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    start = time.perf_counter()
    out = flash_attn_func(q, k, v, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    seconds = time.perf_counter() - start

    errors, _ = reference_errors(q, k, v, out, dout, grads, **options)
    ok = all(err <= allowed_error(base, DTYPE) for _, err, base in errors)
    cells = [f"{err:.1e} ({base:.1e})" for _, err, base in errors]
    print(f"{label:<24} {str((batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)):<28} "
          + "  ".join(cells) + f"  {'ok' if ok else 'FAIL'}  {seconds:6.2f}s")
    return ok


def time_against_sdpa():
    """bf16, batch 4, 16 heads, head dim 128, seqlen 4096: flashtile vs SDPA's backends."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, seqlen, nheads, head_dim = 4, 4096, 16, 128
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
               for _ in range(3))
    systems = {"flashtile": lambda causal: flash_attn_func(q, k, v, causal=causal)}
    for name, backend in (("sdpa-fa2", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(causal, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        systems[name] = call
    print(f"\nTFLOP/s, bf16, batch {batch}, seqlen {seqlen}, {nheads} heads, head dim {head_dim} "
          "(forward; forward+backward):")
    for causal in (False, True):
        flops = 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
        cells = []
        for name, fn in systems.items():
            try:
                fwd_ms = triton.testing.do_bench(lambda: fn(causal), return_mode="median")
                out = fn(causal)
                dout = torch.randn_like(out)
                both_ms = triton.testing.do_bench(
                    lambda: torch.autograd.grad(fn(causal), (q, k, v), dout), return_mode="median")
                cells.append(f"{name} {flops / fwd_ms * 1e-9:5.0f}; {3.5 * flops / both_ms * 1e-9:5.0f}")
            except Exception as exc:  # a backend missing on this GPU
                cells.append(f"{name} unavailable ({type(exc).__name__})")
        print(f"  causal={str(causal):<5}  " + "   ".join(cells))


def run_varlen_check(lengths, nheads, nheads_k, head_dim):
    """A packed batch (flash_attn_varlen_func), each sequence checked as if it ran alone."""
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    total = sum(lengths)
    q = torch.randn(total, nheads, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k = torch.randn(total, nheads_k, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    start = time.perf_counter()
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    seconds = time.perf_counter() - start
    reference = functools.partial(attention_varlen_naive, cu_seqlens_q=cu, cu_seqlens_k=cu)
    errors, _ = reference_errors(q, k, v, out, dout, grads, reference=reference, causal=True)
    ok = all(err <= allowed_error(base, DTYPE) for _, err, base in errors)
    cells = [f"{err:.1e} ({base:.1e})" for _, err, base in errors]
    label, shape = "varlen, causal", f"lengths {lengths}"
    print(f"{label:<24} {shape:<28} " + "  ".join(cells) + f"  {'ok' if ok else 'FAIL'}  {seconds:6.2f}s")
    return ok


def main() -> int:
    where = torch.cuda.get_device_name() if ON_GPU else "CPU through Triton's interpreter (TRITON_INTERPRET=1)"
    print(f"flashtile demo on {where}, {str(DTYPE).replace('torch.', '')}")
    print("relative error vs float64 for out, dq, dk, dv; in brackets PyTorch's own error in the same dtype")
    print(f"{'case':<24} {'(b, sq, sk, h, hk, d)':<28} {'out':<19}{'dq':<19}{'dk':<19}{'dv':<19}")
    ok = all([run_check(*case) for case in CHECKS])
    scale = 8 if ON_GPU else 1
    ok &= run_varlen_check([n * scale for n in (70, 0, 1, 113)], 4, 2, 64)
    if ON_GPU:
        time_against_sdpa()
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
