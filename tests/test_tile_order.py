"""The launch order of causal grids (flashtile/kernels/tile_order.py): the remap is a permutation
with each group's longest tiles first (run through the interpreter on the CPU), and the Gluon
forward, which uses it, computes the same function for any group size, a short group included."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from flashtile import flash_attn_func
from flashtile.configs import FWD_GLUON, override, table_config
from flashtile.kernels.hopper.forward_plan import heads_per_group
from flashtile.kernels.hopper.tile_order import grouped_tile_order
from flashtile.runtime import portable_only

from _cases import DEVICE, ON_GPU, check_against_reference, make_qkv


@triton.jit
def _order_kernel(Out, group_size):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rank, new_head, new_batch = grouped_tile_order(tile, head, batch, tl.num_programs(0), tl.num_programs(1),
                                                   tl.num_programs(2), group_size)
    program = tile + tl.num_programs(0) * (head + tl.num_programs(1) * batch)
    tl.store(Out + 3 * program, rank)
    tl.store(Out + 3 * program + 1, new_head)
    tl.store(Out + 3 * program + 2, new_batch)


@pytest.mark.parametrize("n_tiles,nheads,n_batch", [(5, 3, 2), (1, 4, 1), (4, 1, 3)])
@pytest.mark.parametrize("group_size", [1, 2, 4, 7, 100])
def test_grouped_tile_order(n_tiles, nheads, n_batch, group_size):
    out = torch.full((n_batch, nheads, n_tiles, 3), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(n_tiles, nheads, n_batch)](out, group_size)
    work = [tuple(w) for w in out.view(-1, 3).tolist()]  # in program (launch) order
    assert sorted(work) == sorted((r, h, b) for r in range(n_tiles) for h in range(nheads) for b in range(n_batch))
    pairs = nheads * n_batch
    group = min(group_size, pairs)
    short = pairs % group  # a short group comes first
    bounds = ([0, short * n_tiles] if short else [0]) + list(range(short * n_tiles + group * n_tiles,
                                                                   len(work) + 1, group * n_tiles))
    assert bounds[-1] == len(work)
    for start, end in zip(bounds, bounds[1:]):
        members = work[start:end]
        # Whole (batch, head) pairs per group, ranks in launch order, each rank once per pair.
        assert [r for r, _, _ in members] == sorted(r for r, _, _ in members)
        assert len({(h, b) for _, h, b in members}) * n_tiles == len(members)
    if group_size == 1:
        assert work == [(r, h, b) for b in range(n_batch) for h in range(nheads) for r in range(n_tiles)]


def test_heads_per_group():
    assert heads_per_group(16, 512, 132) == 9  # 132 CTAs over 16 tiles per head
    assert heads_per_group(64, 512, 132, factor=2) == 5
    assert heads_per_group(1000, 512, 132) == 1
    assert heads_per_group(2, 3, 132) == 3  # never more than the pairs


ON_SM90 = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and not portable_only()


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run on sm90 only")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group_size", [1, 3, 64])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (700, 1000), (1000, 700)])
def test_gluon_forward_any_group(head_dim, group_size, seqlen_q, seqlen_k):
    """The Gluon forward's per-tile grid (which long causal keys take at head dims 128 / 256; head dim 64
    runs its causal config persistent, here per tile) with any group size."""
    config = dataclasses.replace(table_config(FWD_GLUON, "sm90", head_dim, causal=True, seqlen_k=2**20),
                                 heads_per_group=group_size, persistent=False)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16)
    with override(fwd_gluon=config):
        check_against_reference(flash_attn_func, q, k, v, causal=True, backward=False)
