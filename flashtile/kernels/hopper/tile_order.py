"""Launch order of causal grids: the longest tiles first, a group of heads at a time.

A causal grid's tiles differ in work: a forward query tile near the end of a sequence sees every
key, one at the start a few. CTAs start in program-id order as SMs free up. When each head's tiles
go longest first but the heads follow one another, the grid ends on the last heads' tiles, long
and short alike, and SMs that are done wait for the last long ones. Ordering a group of heads
together (every head's longest tile, then every head's second longest, ...) ends the grid on the
group's shortest tiles; groups stay small so that the heads in flight share their K/V in L2.

Where it is used: the Gluon forward's per-tile causal grid at head dim 256 (one CTA per SM, few
tiles per head, so the tail matters). It lost elsewhere (docs/experiments.md): the Gluon forward
at head dims 64 / 128; the portable forward (several CTAs share an SM, so its tail costs less); the
Gluon backward (the remapped indices cost its consumer warpgroups registers they do not have),
which instead swaps its grid's first two axes where that pays (GluonBwdConfig.heads_first).

Kernels keep their (tile, head, batch) grids and remap their program ids with
:func:`grouped_tile_order` (a scalar helper that Triton and Gluon kernels can both call); the
host picks the group with forward_plan.heads_per_group.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile_order(tile, head, batch, n_tiles, nheads, n_batch, heads_per_group):
    """The work of program (tile, head, batch) of an (n_tiles, nheads, n_batch) grid: (rank, head,
    batch), where rank 0 is a head's longest tile and n_tiles - 1 its shortest (the caller maps
    rank to its tile). Programs run through groups of heads_per_group (batch, head) pairs, and
    within a group rank by rank. When the pairs do not divide into whole groups, the first group
    is the short one: a short last group would start its long tiles after the others' short ones.
    heads_per_group = 1 keeps the grid's order (rank = tile)."""
    program = tile + n_tiles * (head + nheads * batch)
    short = (nheads * n_batch) % heads_per_group  # pairs in the first group when it is short, else 0
    in_short = program < short * n_tiles
    rest = tl.maximum(program - short * n_tiles, 0)
    group_programs = heads_per_group * n_tiles
    group = rest // group_programs
    first_pair = tl.where(in_short, 0, short + group * heads_per_group)
    pairs = tl.where(in_short, short, heads_per_group)
    offset = tl.where(in_short, program, rest - group * group_programs)
    pair = first_pair + offset % pairs
    return offset // pairs, pair % nheads, pair // nheads
