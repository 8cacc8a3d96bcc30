"""The split-KV combine kernel against the merge done in float64: splits read in several tiles,
row blocks past the last row, and splits or rows without keys (lse = -inf)."""

import pytest
import torch
import triton

from flashtile.kernels.portable.combine import attn_combine_kernel

from _cases import DEVICE


def merged(out_parts, lse_parts):
    """(out (b, r, h, d), lse (b, h, r)) of the lse-weighted sum, in float64; rows without keys: 0, -inf."""
    lse = torch.logsumexp(lse_parts.double(), dim=0)  # (b, h, r)
    weights = torch.exp(lse_parts.double() - lse.nan_to_num(neginf=0.0)).nan_to_num(0.0)  # (s, b, h, r)
    out = (weights.permute(0, 1, 3, 2)[..., None] * out_parts.double()).sum(0)
    return out, lse


@pytest.mark.parametrize("num_splits, block_s", [(1, 4), (6, 4), (9, 4), (5, 16)])
@pytest.mark.parametrize("rows, block_r", [(1, 1), (7, 1), (7, 4)])
def test_combine(num_splits, block_s, rows, block_r):
    batch, nheads, head_dim = 2, 3, 40
    out_parts = torch.randn(num_splits, batch, rows, nheads, head_dim, device=DEVICE)
    lse_parts = torch.randn(num_splits, batch, nheads, rows, device=DEVICE) * 3
    lse_parts[num_splits // 2, 0] = float("-inf")  # a split that saw no key of these rows
    lse_parts[:, 1, 2, 0] = float("-inf")  # a row no split saw
    out = torch.full((batch, rows, nheads, head_dim), float("nan"), device=DEVICE, dtype=torch.float16)
    lse = torch.full((batch, nheads, rows), float("nan"), device=DEVICE)
    attn_combine_kernel[(triton.cdiv(rows, block_r), nheads, batch)](
        out_parts, lse_parts, out, lse, *out_parts.stride()[:4], *lse_parts.stride()[:3], out.stride(0),
        out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), rows, num_splits,
        HEAD_DIM=head_dim, BLOCK_D=64, BLOCK_R=block_r, BLOCK_S=block_s)
    want_out, want_lse = merged(out_parts, lse_parts)
    assert torch.equal(lse[1, 2, 0].cpu(), torch.tensor(float("-inf"))) and not out[1, 0, 2].any()
    torch.testing.assert_close(out.double(), want_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
