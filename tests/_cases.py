"""Devices, dtypes and shapes the tests sweep: small on the CPU interpreter (bf16 is
not supported there: its tl.dot multiplies raw bits), larger and bf16 on the GPU."""

import torch

from flashtile.reference import attention_naive
from flashtile.testing import call_errors, check_errors, check_lse, reference_errors

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _inductor_mismatch():
    """Why torch's own compiler (inductor) cannot be trusted with the Triton in use, or None: a CUDA
    build of torch names the Triton it was built with, and inductor calls Triton internals that move
    between releases. flashtile itself supports any Triton in its range."""
    import importlib.metadata

    import triton

    for req in importlib.metadata.requires("torch") or ():
        name, _, rest = req.partition("==")
        if name.strip() == "triton" and rest:
            built = rest.split(";")[0].strip()
            if built != triton.__version__:
                return f"torch {torch.__version__} was built with triton {built}, this run has {triton.__version__}"
    return None


# torch.compile tests compile with inductor on the GPU unless it does not pair with this Triton:
# then with aot_eager (dynamo, fake tensors and AOT autograd around the same kernels).
INDUCTOR_MISMATCH = _inductor_mismatch() if ON_GPU else None

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]
HEAD_DIMS = [40, 64, 96, 128, 200, 256] if ON_GPU else [32, 40, 64, 96]
# (seqlen_q, seqlen_k): equal, odd, single-token, and both orders of unequal lengths.
SEQLENS = ([(1, 1), (1, 239), (113, 203), (128, 217), (239, 1), (512, 256), (1023, 1023), (2048, 2048), (799, 3)]
           if ON_GPU else [(1, 1), (1, 37), (37, 37), (113, 113), (113, 60), (60, 113), (128, 128)])
BATCH, NHEADS = (2, 4) if ON_GPU else (2, 2)

# (causal, window_size) combinations.
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8)), (True, (24, -1)), (False, (0, 0)), (False, (-1, 7))]


def randn(*shape, dtype, requires_grad=False):
    t = torch.randn(*shape, device=DEVICE, dtype=dtype)
    return t.requires_grad_(requires_grad)


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, requires_grad=True):
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, requires_grad=requires_grad)
    k = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, requires_grad=requires_grad)
    v = randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def make_packed_qkv(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, requires_grad=True):
    """q (total_q, h, d), k and v (total_k, hk, d) of a packed batch of these sequence lengths, and
    their int32 cu_seqlens_q, cu_seqlens_k."""
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                  for lengths in (lengths_q, lengths_k))
    q = randn(sum(lengths_q), nheads, head_dim, dtype=dtype, requires_grad=requires_grad)
    k, v = (randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, requires_grad=requires_grad) for _ in range(2))
    return q, k, v, cu_q, cu_k


def check_against_reference(fn, q, k, v, *, backward=True, reference=attention_naive, **options):
    """Run ``fn(q, k, v, return_attn_probs=True, **options)`` and check out, lse and
    (if ``backward``) dq, dk, dv against float64, with PyTorch's same-dtype error as the yardstick
    (flashtile.testing.call_errors: with dropout, the reference applies the kernel's own mask)."""
    errors, lse, ref_lse = call_errors(fn, q, k, v, backward=backward, reference=reference, **options)
    check_errors(errors, q.dtype)
    check_lse(lse, ref_lse)
