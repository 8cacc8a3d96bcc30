"""Kernel launch configurations, kept as data.

Every kernel launch takes its tile sizes, warps and pipeline depth from a config
object (:class:`KernelConfig` for the portable Triton kernels, :class:`GluonFwdConfig`
for the Hopper forward, :class:`RowBlockConfig` for the backward preprocess); the tables
below say which config serves which (architecture, kernel, head dim, causal, seqlen range,
dtype). Nothing in the launch code hard-codes a tile size.
"""

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import triton


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Tile shape and scheduling of one portable Triton kernel launch.

    block_m: query rows per tile; block_n: key rows per tile.
    num_warps / num_stages: Triton's warps per program and software-pipelining depth.
    use_tma: move tiles with the copy engine through tensor descriptors (sm90+), when
        the tensors' alignment allows it; otherwise the kernel falls back to pointer loads.
    warp_specialize: let Triton split the main loop into producer and consumer warps
        (needs use_tma to pay off).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    use_tma: bool = False
    warp_specialize: bool = False

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True, kw_only=True)
class RowBlockConfig:
    """A kernel that streams rows (the backward preprocess): block_m rows per program."""

    block_m: int
    num_warps: int = 4


@dataclass(frozen=True, kw_only=True)
class GluonFwdConfig:
    """The Hopper (sm90) warp-specialized forward (flashtile/kernels/hopper/forward.py).

    A CTA holds num_consumers (1 to 4) warpgroups of 64 query rows each and one TMA loader warp.
    block_n: keys per K/V tile; num_stages: depth of the K/V shared-memory ring;
    consumer_regs / loader_regs: registers per thread each role asks for (setmaxnreg);
    pingpong: the consumer warpgroups take turns issuing their matmuls (FA3's
    inter-warpgroup overlap: one's softmax runs under the other's matmuls).
    persistent: about one CTA per SM, each looping over query tiles (dense batches only;
    varlen calls take the one-CTA-per-tile grid): the next tile's Q and K/V load while a
    tile's last P V and output store run, which short sequences (few key blocks per tile)
    feel most. Costs a second Q-sized shared-memory buffer for staging O.
    row_sum_mma: the tensor cores take the softmax's row sums (l += P 1 beside O += P V),
    which frees issue slots where the softmax bounds the loop (head dim 64) and costs tensor
    time where the matmuls do. l then sums the bf16 / fp16 P that P V multiplies, so lse
    carries P's rounding: at most 4e-3 (bf16) / 5e-4 (fp16) off, against ~1e-6 otherwise
    (a bf16 number's own rounding is 4e-3).
    heads_per_group: causal grids that are not persistent (dense batches) run groups of this
    many (batch, head) pairs, each group's longest tiles first (kernels/tile_order.py); 1: one
    head after another, each longest tile first; 0: groups of about one CTA per SM.
    """

    block_n: int
    num_stages: int
    num_consumers: int = 2
    consumer_regs: int = 240
    loader_regs: int = 40
    pingpong: bool = False
    persistent: bool = False
    row_sum_mma: bool = False
    # Causal, head dim 64: a warpgroup whose rows see only the first half of the tile's last key
    # block (the diagonal) multiplies just that half: 64 x 64 instead of 64 x 128. Works with ping-pong;
    # no table rule uses it since own_key_range (below) with four consumers led from 2k keys.
    trim_diagonal: bool = False
    heads_per_group: int = 1
    # Causal, without ping-pong: each consumer warpgroup stops at the last key block its own 64 rows
    # see (the tile's first warpgroups skip the blocks only later rows see, releasing their ring
    # slots unread) and masks only the blocks its own rows cut.
    own_key_range: bool = False
    # CTAs per SM: above 1 the launch caps registers per thread (ptxas maxnreg) so that this many
    # share an SM's register file, and persistent grids launch this many per SM. Each CTA must also fit
    # its share of shared memory. Each streams its own K/V for its own tiles, so one CTA's tile starts
    # and ends overlap the others' key loops (with one consumer warpgroup per CTA: tiles of 64 rows).
    ctas_per_sm: int = 1

    @property
    def block_m(self) -> int:
        return self.num_consumers * 64


@dataclass(frozen=True, kw_only=True)
class GluonBwdConfig:
    """The Hopper (sm90) warp-specialized backward (flashtile/kernels/hopper/backward.py).

    A CTA holds 128 keys (two consumer warpgroups of 64; at head dim 256, 64 keys and each
    warpgroup owns half the head dim) and one TMA loader warp, and streams query tiles past
    them. block_m: query rows per streamed Q/dO tile; num_stages: depth of the Q/dO ring;
    consumer_regs / loader_regs: setmaxnreg per role.
    """

    block_m: int
    num_stages: int
    consumer_regs: int = 240
    loader_regs: int = 24
    # Head dim 256 only: issue the product of the second 64-column dQ tile before the first is
    # stored (overlap for 32 more registers per thread).
    dq_overlap: bool = False
    # Dense batches: launch the dQ convert as a programmatic dependent launch that starts converting
    # each (batch, KV head) as soon as its key blocks are done, on the SMs the kernel's last wave
    # leaves idle (hopper/backward.py, "The dQ convert overlapped with the kernel's last CTAs").
    overlap_convert: bool = False
    # Dense batches: the grid's first axis is the KV head, not the key block, so CTAs start with
    # every head's first key block of a batch, then every head's second, ... In a causal grid key
    # block 0 has the most query blocks: a batch's longest CTAs go first and its shortest end it,
    # instead of the grid ending on the last head's long ones. (Both indices stay special-register
    # reads; a computed remap cost the consumers registers, kernels/tile_order.py.) Concurrent CTAs
    # then span a batch's heads, which shares less in L2: it loses on long or full-mask grids.
    heads_first: bool = False
    # Dense batches, head dims 64 (block_m 128): one CTA per SM runs key blocks one after another,
    # drawing them from a counter, so no CTA launch separates them and the next key block's first
    # Q / dO tiles load while the current one ends (hopper/backward.py, "Persistent backward").
    # Packed batches and other head dims run the per-key-block kernel (the flag is ignored).
    persistent: bool = False

    @property
    def dq_split_m(self) -> bool:
        # Each warpgroup computes dQ for 64 of the block_m query rows (block_m = 128), or for
        # one half of the head dim (block_m = 64): both splits fall on 64-element boundaries
        # of the 128-byte swizzled tiles, so every matmul operand is a whole-atom view.
        return self.block_m == 128


Config = Union[KernelConfig, RowBlockConfig, GluonFwdConfig, GluonBwdConfig]


@dataclass(frozen=True)
class Rule:
    """One row of a config table: ``config`` serves head dims up to ``max_head_dim``
    (padded to a power of two), the given causal flag (None: both), key lengths in
    [min_seqlen_k, max_seqlen_k), the given dtypes (empty: all), packed (varlen) or dense
    batches (None: both), and keys read through a block table (paged) or not (None: both).
    First match wins.
    A ``None`` config means "this kernel does not serve these shapes"."""

    max_head_dim: int
    config: Optional[Config]
    causal: Optional[bool] = None
    min_seqlen_k: int = 0
    max_seqlen_k: int = 2**62
    dtypes: tuple = ()
    varlen: Optional[bool] = None
    paged: Optional[bool] = None

    def matches(self, head_dim: int, causal: bool, seqlen_k: int, dtype, varlen: bool = False,
                paged: bool = False) -> bool:
        return (padded_head_dim(head_dim) <= self.max_head_dim
                and (self.causal is None or self.causal == causal)
                and self.min_seqlen_k <= seqlen_k < self.max_seqlen_k
                and (not self.dtypes or dtype in self.dtypes)
                and (self.varlen is None or self.varlen == varlen)
                and (self.paged is None or self.paged == paged))


@functools.lru_cache(maxsize=None)
def padded_head_dim(head_dim: int) -> int:
    """Head dims are processed in a power-of-two tile (tl.dot needs at least 16)."""
    return max(16, triton.next_power_of_2(head_dim))


def tile_head_dim(q, v) -> int:
    """The head dim that picks a call's configs: the wider of Q's (and K's) and V's (with
    head_dim_v != head_dim_qk both live in one program's registers)."""
    return max(q.shape[-1], v.shape[-1])


# Kernel names used in the tables.
FWD = "fwd"          # forward: one program per (query block, head, batch)
FWD_DECODE = "fwd_decode"  # the same kernel on few query rows per sequence (decoding): small query tiles
# The same for 17 to DECODE_PACKED_MAX_ROWS tile rows: a few query rows per sequence with a GQA group's
# heads packed into each tile's rows (speculative decoding), or one query with a group of 17-64 heads as rows.
FWD_DECODE_PACKED = "fwd_decode_packed"
BWD_DKDV = "bwd_dkdv"  # backward, dK/dV: one program per (key block, kv head, batch)
BWD_DQ = "bwd_dq"    # backward, dQ: one program per (query block, head, batch)
FWD_GLUON = "fwd_gluon"  # Hopper forward: warp-specialized Gluon kernel (sm90, fp16/bf16)
BWD_GLUON = "bwd_gluon"  # Hopper backward: dK/dV and (atomically) dQ in one Gluon kernel
# Backward preprocess: delta = rowsum(dO * O), lse in log2 units (and the Gluon backward's dQ
# accumulator zeroed); a memory-bound pass over rows.
BWD_PREPROCESS = "bwd_preprocess"
KERNELS = (FWD, FWD_DECODE, FWD_DECODE_PACKED, BWD_DKDV, BWD_DQ, FWD_GLUON, BWD_GLUON, BWD_PREPROCESS)

# A packed forward whose sequences have at most this many query rows (a decoding step: one token,
# or the query heads of a GQA group as rows) takes the FWD_DECODE config. Its work is streaming K
# and V: a 16-row query tile (tl.dot's least) keeps the matmuls far below the memory time.
DECODE_MAX_ROWS = 16
# Decode tile rows (packed GQA rows, or a group's heads as rows) up to this many take FWD_DECODE_PACKED's
# 64-row tile: K and V read once per kv head, and no half-empty 128-row prefill tile (its matmuls outlast
# the reads). Above it, the FWD tile, or packed rows on several 64-row ones (dispatch._packed_rows_on_64_row_tiles).
DECODE_PACKED_MAX_ROWS = 64
# Calls with at most DECODE_MAX_ROWS query rows per sequence run as decoding (dispatch.decode_route), and
# so do those of up to DECODE_ROUTE_MAX_ROWS whose keys number at least DECODE_ROUTE_KEYS_PER_ROW per
# query row: split-KV and a GQA group's heads sharing tiles, where the Hopper kernel's 128-row tile would
# sit at least half empty and read K and V once per query head. With fewer keys (short square calls)
# the route lost to the Hopper kernel at some shapes, the causal ones (docs/experiments.md, 2026-12-01).
DECODE_ROUTE_MAX_ROWS = 64
DECODE_ROUTE_KEYS_PER_ROW = 16
# Such a call whose GQA groups pack into more than DECODE_PACKED_MAX_ROWS rows per kv head (and at least
# one of the Hopper config's tiles) runs on the Hopper forward instead (dispatch.packed_gqa_on_hopper) once
# those tiles number at least this many per multiprocessor: the work is then the tiles' matmuls, and split-KV
# has little left to fill. H200, 32 rows x 32/8 heads at d128: 64 tiles on 132 SMs ran slower on the Hopper
# forward, 96 and more faster (docs/experiments.md, 2026-12-02).
PACKED_GQA_HOPPER_TILES_PER_SM = 0.6

# The interpreter runs tiles as numpy arrays: small tiles keep multi-block paths
# exercised at the small sequence lengths CPU tests use.
_INTERPRETER = {
    FWD: KernelConfig(block_m=32, block_n=32),
    FWD_DECODE: KernelConfig(block_m=16, block_n=32),
    FWD_DECODE_PACKED: KernelConfig(block_m=32, block_n=32),
    BWD_DKDV: KernelConfig(block_m=32, block_n=32),
    BWD_DQ: KernelConfig(block_m=32, block_n=32),
    FWD_GLUON: None,
    BWD_GLUON: None,
    BWD_PREPROCESS: RowBlockConfig(block_m=32),
}

# Portable GPU defaults, keyed by the padded head dim (upper bound). Chosen to fit
# registers and shared memory on sm80/sm90; tuned values per arch go in _TUNED.
_DEFAULT_GPU = {
    FWD: [
        Rule(64, KernelConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)),
        Rule(128, KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)),
        Rule(256, KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)),
    ],
    FWD_DECODE: [
        Rule(128, KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)),
        Rule(256, KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)),
    ],
    # One 64-row tile for a kv head's packed rows: K and V read once, and no empty rows for the matmuls to
    # outlast the reads (the H200 sweep that chose it: experiments.md).
    FWD_DECODE_PACKED: [
        Rule(128, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)),
        Rule(256, KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)),
    ],
    BWD_DKDV: [
        Rule(64, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
        Rule(128, KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)),
        Rule(256, KernelConfig(block_m=32, block_n=64, num_warps=8, num_stages=1)),
    ],
    BWD_DQ: [
        Rule(64, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
        Rule(128, KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)),
        Rule(256, KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=1)),
    ],
    FWD_GLUON: [],  # Hopper only
    BWD_GLUON: [],
    BWD_PREPROCESS: [Rule(256, RowBlockConfig(block_m=64))],
}

# The sm90 table's head-dim-64 forward configs. Each rule below is the winner of A/B runs on an H200
# at 1k-16k keys; docs/experiments.md keeps the numbers and the commits that hold the runs.
#
# Three consumer warpgroups: non-causal from 2k keys (dense, persistent) / 4k (packed), and causal
# packed batches from 8k keys.
_D64_THREE_CONSUMERS = GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                      loader_regs=24, row_sum_mma=True)
_D64_THREE_CONSUMERS_PERSISTENT = replace(_D64_THREE_CONSUMERS, persistent=True)
# Short keys: four consumer warpgroups (256-row tiles, so a 1k head is 4 whole tiles; at 112 registers
# per thread the key blocks are 64 wide), persistent. Causal from 2k keys: each warpgroup stops at its
# own diagonal (own_key_range), and a 10-deep K/V ring lets the warpgroups of a tile drift apart by the
# 1-3 blocks their key ranges differ.
_D64_FOUR_CONSUMERS_PERSISTENT = GluonFwdConfig(block_n=64, num_stages=4, num_consumers=4, consumer_regs=112,
                                                loader_regs=24, persistent=True, row_sum_mma=True)
_D64_FOUR_CONSUMERS_OWN_RANGE = replace(_D64_FOUR_CONSUMERS_PERSISTENT, num_stages=10, own_key_range=True)
# Causal dense batches below 2k keys: CTAs of one consumer warpgroup (64-row tiles, 64-key blocks), three
# per SM, persistent over causal pairs of tiles. The tiles are as small as the portable kernel's (the
# diagonal wastes as little), but each CTA overlaps its softmax with its next S = Q K^T and has a loader
# warp; from 2k keys the four-consumer tiles win again.
_D64_ONE_CONSUMER_X3 = GluonFwdConfig(block_n=64, num_stages=2, num_consumers=1, consumer_regs=136, loader_regs=24,
                                      persistent=True, row_sum_mma=True, ctas_per_sm=3)

# Decode-shaped GQA calls that run on the Hopper forward with each group's query heads packed as rows
# (dispatch.packed_gqa_on_hopper) take these configs by architecture and padded head dim, else the dense
# table's. Their tiles all read the same keys (a causal call runs as a band), so the causal schedules buy
# nothing: d128 takes the non-causal two-stage tile either way, d64 four consumers over a 10-deep ring
# with or without causal (the dense table's non-causal three-consumer tile measured well behind it on
# packed rows; A/B runs in docs/experiments.md, 2026-12-02).
_PACKED_GQA_GLUON_FWD = {
    "sm90": {64: replace(_D64_FOUR_CONSUMERS_PERSISTENT, num_stages=10),
             128: GluonFwdConfig(block_n=128, num_stages=2)},
}

# Per architecture: {arch: {kernel: [Rule, ...]}}, the first matching rule wins. sm90 (H100/H200) was
# tuned on an H200 in bf16 at 1k-16k tokens, hidden 2048: the portable kernels by the best geometric
# mean over causal and non-causal (`python -m flashtile tune` repeats such a search), the Hopper
# kernels by A/B runs of their candidates (GLUON_CANDIDATES below). Head dims a Gluon list does not
# serve fall back to the portable kernels (a None config).
_TUNED: dict = {
    "sm90": {
        FWD: [
            # Causal d64 packed batches below 8k keys (dense ones run the Gluon forward on sm90): 64-row
            # tiles waste less on the diagonal.
            Rule(64, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, use_tma=True), causal=True),
            Rule(64, KernelConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=True)),
            # Keys through a block table (pages too small for the Hopper forward): no TMA, and a page-number
            # load ahead of each K/V load, which five stages keep double-buffered (FWD_DECODE's note below).
            Rule(128, KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=5), paged=True),
            Rule(128, KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True,
                                   warp_specialize=True)),
            Rule(256, KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)),
        ],
        # Decoding at head dims up to 64: 64-key steps four deep (a 64 KB K/V ring) keep more loads in
        # flight per multiprocessor than the default's 128-key steps three deep, at the split counts
        # _auto_splits picks (the H200 sweeps: docs/experiments.md, 2026-12-02).
        # Through a block table, each K/V load waits on a page-number load, and Triton's pipeliner
        # shares the stages among such a chain: five stages keep K and V double-buffered, as three do
        # on a contiguous cache (three or four leave one buffer, and paged reads lag contiguous ones).
        # The packed decode tile and the prefill tile take five stages through a table too (the H200
        # sweeps: docs/experiments.md, 2026-12-03).
        FWD_DECODE: [
            Rule(64, KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=5), paged=True),
            Rule(128, KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=5), paged=True),
            Rule(64, KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)),
        ],
        FWD_DECODE_PACKED: [
            Rule(128, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=5), paged=True),
        ],
        FWD_GLUON: [
            # Dense batches with short keys: persistent CTAs (the next tile loads under a tile's last
            # P V and output store). Packed batches keep the per-tile grid. Head dim 64 takes its row
            # sums on the tensor cores (its loop is bound by the softmax's issue slots); at d128 / d256
            # the tensor cores are the bound and the row sums stay on the CUDA cores.
            Rule(64, _D64_FOUR_CONSUMERS_PERSISTENT, causal=False, max_seqlen_k=2048, varlen=False),
            Rule(64, _D64_THREE_CONSUMERS_PERSISTENT, causal=False, min_seqlen_k=2048, varlen=False),
            Rule(64, _D64_THREE_CONSUMERS, causal=False, min_seqlen_k=4096),
            Rule(64, _D64_ONE_CONSUMER_X3, causal=True, max_seqlen_k=2048, varlen=False),
            Rule(64, _D64_FOUR_CONSUMERS_OWN_RANGE, causal=True, min_seqlen_k=2048, varlen=False),
            Rule(64, _D64_THREE_CONSUMERS, causal=True, min_seqlen_k=8192),
            Rule(64, None),
            # Head dims 96 and 192 (padded to 128 / 256) take these rules: they run the d128 / d256
            # kernels on tiles of the padded width (hopper/tma.py's HEAD_DIMS lists what it serves).
            Rule(128, GluonFwdConfig(block_n=128, num_stages=2, pingpong=True), varlen=True),
            Rule(128, GluonFwdConfig(block_n=128, num_stages=2, persistent=True), causal=False, max_seqlen_k=4096),
            Rule(128, GluonFwdConfig(block_n=128, num_stages=2), causal=False),
            Rule(128, GluonFwdConfig(block_n=128, num_stages=2, pingpong=True, persistent=True), causal=True,
                 max_seqlen_k=16384),
            Rule(128, GluonFwdConfig(block_n=128, num_stages=2), causal=True),
            # A persistent d256 CTA would need 256 KB of shared memory with its O staging buffer. Causal:
            # groups of heads, each group's longest tiles first (one CTA per SM leaves few tiles per
            # head, so the order matters here; at d64 / d128 it lost).
            Rule(256, GluonFwdConfig(block_n=64, num_stages=2, pingpong=True, heads_per_group=0)),
        ],
        BWD_GLUON: [
            # Head dim 64: one CTA per SM running key block after key block (GluonBwdConfig.persistent;
            # varlen batches run the per-key-block kernel): no launch separates key blocks.
            Rule(64, GluonBwdConfig(block_m=128, num_stages=2, persistent=True)),
            # Also head dim 96 (and 192 below), on tiles of the padded width. Causal grids below 8k keys
            # start every head's longest key block first, so the grid does not end on long CTAs; at
            # 16k, and at head dims 64 / 256, the L2 locality of head-major order wins instead.
            Rule(128, GluonBwdConfig(block_m=64, num_stages=2, heads_first=True), causal=True, max_seqlen_k=8192),
            Rule(128, GluonBwdConfig(block_m=64, num_stages=2)),
            # 64 keys per CTA, each warpgroup half of the head dim: block_m 64 with 2 stages is what
            # fits shared memory. The dQ convert overlaps the kernel's last CTAs (a partial last wave
            # leaves SMs idle at this size; at head dims 64 / 128 it did not pay).
            Rule(256, GluonBwdConfig(block_m=64, num_stages=2, overlap_convert=True)),
        ],
        BWD_DKDV: [
            Rule(64, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
            Rule(128, KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=3)),
            Rule(256, KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)),
        ],
        BWD_DQ: [
            Rule(64, KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)),
            Rule(128, KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)),
            Rule(256, KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)),
        ],
        # A memory-bound row pass: small blocks keep every SM busy at short lengths and cost nothing
        # at long ones.
        BWD_PREPROCESS: [Rule(256, RowBlockConfig(block_m=32))],
    },
}


# Alternatives to the tables for the portable kernels, per kernel and padded head dim: what
# `python -m flashtile tune` and FLASHTILE_AUTOTUNE=1 search
# (flashtile/autotune.py). The Hopper kernels' alternatives follow (GLUON_CANDIDATES).
_C = KernelConfig
PORTABLE_CANDIDATES = {
    FWD: {
        64: [
            _C(block_m=64, block_n=64, num_warps=4, num_stages=3),
            _C(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=True),
            _C(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=4, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True),
            _C(block_m=64, block_n=64, num_warps=4, num_stages=3, use_tma=True),
            _C(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=64, num_warps=4, num_stages=4, use_tma=True),
            _C(block_m=128, block_n=32, num_warps=4, num_stages=3, use_tma=True),
            _C(block_m=64, block_n=32, num_warps=4, num_stages=4, use_tma=True),
        ],
        128: [
            _C(block_m=128, block_n=64, num_warps=8, num_stages=3),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True),
            _C(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=4, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=True, warp_specialize=True),
        ],
        256: [
            _C(block_m=128, block_n=64, num_warps=8, num_stages=2),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=2, use_tma=True),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=2, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=True, warp_specialize=True),
            _C(block_m=64, block_n=128, num_warps=4, num_stages=2, use_tma=True, warp_specialize=True),
            _C(block_m=128, block_n=32, num_warps=8, num_stages=3, use_tma=True, warp_specialize=True),
            _C(block_m=64, block_n=64, num_warps=4, num_stages=3, use_tma=True, warp_specialize=True),
        ],
    },
    FWD_DECODE: {
        d: [_C(block_m=16, block_n=n, num_warps=w, num_stages=st)
            for n in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4) if d * n <= 128 * 128]
        for d in (16, 32, 64, 128, 256)
    },
    FWD_DECODE_PACKED: {
        d: [_C(block_m=m, block_n=n, num_warps=w, num_stages=st)
            for m in (32, 64) for n in (64, 128) for w in (4, 8) for st in (2, 3) if d * n <= 128 * 128]
        for d in (16, 32, 64, 128, 256)
    },
    BWD_DKDV: {
        64: [
            _C(block_m=64, block_n=64, num_warps=4, num_stages=2),
            _C(block_m=32, block_n=128, num_warps=4, num_stages=3),
            _C(block_m=32, block_n=64, num_warps=4, num_stages=3),
            _C(block_m=64, block_n=128, num_warps=8, num_stages=2),
            _C(block_m=32, block_n=128, num_warps=8, num_stages=3),
            _C(block_m=16, block_n=64, num_warps=4, num_stages=3),
        ],
        128: [
            _C(block_m=64, block_n=64, num_warps=8, num_stages=2),
            _C(block_m=32, block_n=64, num_warps=4, num_stages=3),
            _C(block_m=32, block_n=128, num_warps=8, num_stages=3),
            _C(block_m=32, block_n=128, num_warps=8, num_stages=2),
            _C(block_m=64, block_n=128, num_warps=8, num_stages=2),
            _C(block_m=16, block_n=64, num_warps=4, num_stages=3),
            _C(block_m=32, block_n=64, num_warps=8, num_stages=2),
        ],
        256: [
            _C(block_m=32, block_n=64, num_warps=8, num_stages=1),
            _C(block_m=32, block_n=64, num_warps=8, num_stages=2),
            _C(block_m=16, block_n=64, num_warps=4, num_stages=2),
            _C(block_m=32, block_n=32, num_warps=4, num_stages=2),
            _C(block_m=64, block_n=64, num_warps=8, num_stages=1),
            _C(block_m=16, block_n=128, num_warps=8, num_stages=2),
        ],
    },
    BWD_DQ: {
        64: [
            _C(block_m=64, block_n=64, num_warps=4, num_stages=2),
            _C(block_m=128, block_n=32, num_warps=4, num_stages=3),
            _C(block_m=64, block_n=32, num_warps=4, num_stages=3),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=2),
            _C(block_m=128, block_n=32, num_warps=8, num_stages=3),
        ],
        128: [
            _C(block_m=64, block_n=64, num_warps=8, num_stages=2),
            _C(block_m=64, block_n=32, num_warps=4, num_stages=3),
            _C(block_m=128, block_n=32, num_warps=8, num_stages=3),
            _C(block_m=128, block_n=64, num_warps=8, num_stages=2),
            _C(block_m=64, block_n=64, num_warps=4, num_stages=3),
            _C(block_m=128, block_n=32, num_warps=4, num_stages=2),
        ],
        256: [
            _C(block_m=64, block_n=32, num_warps=8, num_stages=1),
            _C(block_m=64, block_n=32, num_warps=8, num_stages=2),
            _C(block_m=64, block_n=32, num_warps=4, num_stages=2),
            _C(block_m=32, block_n=64, num_warps=4, num_stages=2),
            _C(block_m=128, block_n=32, num_warps=8, num_stages=2),
            _C(block_m=64, block_n=16, num_warps=4, num_stages=2),
        ],
    },
}


# Alternatives for the Hopper kernels, by padded head dim and name: what the autotuner searches
# besides the table's choice, and what `python -m flashtile configs` lists. All compile for sm90.
_GLUON_FWD_CANDIDATES = {
    64: {
        "c2_n128_s3": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240, loader_regs=40,
                                     pingpong=False),
        "c2_n128_s3_pp": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240,
                                        loader_regs=40, pingpong=True),
        "c3_n128_s2": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160, loader_regs=24,
                                     pingpong=False),
        "c3_n128_s2_pp": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                        loader_regs=24, pingpong=True),
        # Persistent (one CTA per SM looping over tiles).
        "c2_n128_s3_pp_persist": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240,
                                                loader_regs=40, pingpong=True, persistent=True),
        "c3_n128_s2_persist": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                             loader_regs=24, pingpong=False, persistent=True),
        "c3_n128_s2_pp_persist": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                                loader_regs=24, pingpong=True, persistent=True),
        "c2_n64_s4_pp_persist": GluonFwdConfig(block_n=64, num_stages=4, num_consumers=2, consumer_regs=240,
                                               loader_regs=40, pingpong=True, persistent=True),
        "c3_n64_s4_pp_persist": GluonFwdConfig(block_n=64, num_stages=4, num_consumers=3, consumer_regs=160,
                                               loader_regs=24, pingpong=True, persistent=True),
        # Row sums on the tensor cores (the table's choices at d64).
        "c2_n128_s3_pp_persist_rs": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240,
                                                   loader_regs=40, pingpong=True, persistent=True, row_sum_mma=True),
        "c2_n128_s3_persist_rs": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240,
                                                loader_regs=40, pingpong=False, persistent=True, row_sum_mma=True),
        "c3_n128_s2_rs": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                        loader_regs=24, pingpong=False, persistent=False, row_sum_mma=True),
        "c3_n128_s2_pp_rs": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                           loader_regs=24, pingpong=True, persistent=False, row_sum_mma=True),
        # Causal: half-width products on the diagonal block (GluonFwdConfig.trim_diagonal).
        "c2_n128_s3_pp_persist_rs_trim": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2,
                                                        consumer_regs=240, loader_regs=40, pingpong=True,
                                                        persistent=True, row_sum_mma=True, trim_diagonal=True),
        "c3_n128_s2_persist_rs_trim": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=3, consumer_regs=160,
                                                     loader_regs=24, pingpong=False, persistent=True,
                                                     row_sum_mma=True, trim_diagonal=True),
        # Four consumers (256-row tiles) fit 112 registers with 64-key blocks (120 spills more).
        "c4_n64_s4_persist_rs": GluonFwdConfig(block_n=64, num_stages=4, num_consumers=4, consumer_regs=112,
                                               loader_regs=24, pingpong=False, persistent=True, row_sum_mma=True),
        "c4_n64_s4_rs_own": GluonFwdConfig(block_n=64, num_stages=4, num_consumers=4, consumer_regs=112,
                                           loader_regs=24, pingpong=False, persistent=False, row_sum_mma=True,
                                           own_key_range=True),
        "c4_n64_s10_persist_rs_own": GluonFwdConfig(block_n=64, num_stages=10, num_consumers=4, consumer_regs=112,
                                                    loader_regs=24, pingpong=False, persistent=True,
                                                    row_sum_mma=True, own_key_range=True),
        # One consumer warpgroup per CTA, three CTAs per SM (GluonFwdConfig.ctas_per_sm): the table's
        # causal choice below 2k keys, its three-stage twin and the per-tile grid.
        "c1_n64_s2_persist_rs_x3": GluonFwdConfig(block_n=64, num_stages=2, num_consumers=1, consumer_regs=136,
                                                  loader_regs=24, pingpong=False, persistent=True, row_sum_mma=True,
                                                  ctas_per_sm=3),
        "c1_n64_s3_persist_rs_x3": GluonFwdConfig(block_n=64, num_stages=3, num_consumers=1, consumer_regs=136,
                                                  loader_regs=24, pingpong=False, persistent=True, row_sum_mma=True,
                                                  ctas_per_sm=3),
        "c1_n64_s4_rs_x3": GluonFwdConfig(block_n=64, num_stages=4, num_consumers=1, consumer_regs=136,
                                          loader_regs=24, pingpong=False, persistent=False, row_sum_mma=True,
                                          ctas_per_sm=3),
    },
    128: {
        "c2_n128_s2": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=2, consumer_regs=240, loader_regs=40,
                                     pingpong=False),
        "c2_n128_s2_pp": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=2, consumer_regs=240,
                                        loader_regs=40, pingpong=True),
        "c2_n128_s3": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240, loader_regs=40,
                                     pingpong=False),
        "c2_n128_s3_pp": GluonFwdConfig(block_n=128, num_stages=3, num_consumers=2, consumer_regs=240,
                                        loader_regs=40, pingpong=True),
        "c2_n64_s4": GluonFwdConfig(block_n=64, num_stages=4, num_consumers=2, consumer_regs=240, loader_regs=40,
                                    pingpong=False),
        "c2_n128_s2_pp_persist": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=2, consumer_regs=240,
                                                loader_regs=40, pingpong=True, persistent=True),
        "c2_n128_s2_persist": GluonFwdConfig(block_n=128, num_stages=2, num_consumers=2, consumer_regs=240,
                                             loader_regs=40, pingpong=False, persistent=True),
    },
    256: {
        "c2_n64_s2": GluonFwdConfig(block_n=64, num_stages=2, num_consumers=2, consumer_regs=240, loader_regs=40,
                                    pingpong=False),
        "c2_n64_s2_pp": GluonFwdConfig(block_n=64, num_stages=2, num_consumers=2, consumer_regs=240, loader_regs=40,
                                       pingpong=True),
    },
}

_GLUON_BWD_CANDIDATES = {
    # d64 with 3 stages needs 232960 bytes of shared memory (> 232448): not a candidate.
    64: {
        "m128_s2": GluonBwdConfig(block_m=128, num_stages=2, consumer_regs=240, loader_regs=24),
        "m128_s2_oc": GluonBwdConfig(block_m=128, num_stages=2, consumer_regs=240, loader_regs=24,
                                     overlap_convert=True),
        "m128_s2_hf": GluonBwdConfig(block_m=128, num_stages=2, heads_first=True),
        "m128_s2_ps": GluonBwdConfig(block_m=128, num_stages=2, persistent=True),
    },
    128: {
        "m64_s2": GluonBwdConfig(block_m=64, num_stages=2, consumer_regs=240, loader_regs=24),
        "m64_s3": GluonBwdConfig(block_m=64, num_stages=3, consumer_regs=240, loader_regs=24),
        "m64_s2_oc": GluonBwdConfig(block_m=64, num_stages=2, consumer_regs=240, loader_regs=24,
                                    overlap_convert=True),
        "m64_s2_hf": GluonBwdConfig(block_m=64, num_stages=2, heads_first=True),
    },
    # d256: 64 keys per CTA; block_m 64 with 2 stages fills shared memory (230 KB). block_m 32
    # would make dQ's wgmma M (query rows) 32 < 64. dq_overlap: see GluonBwdConfig.
    256: {
        "m64_s2": GluonBwdConfig(block_m=64, num_stages=2, consumer_regs=240, loader_regs=24),
        "m64_s2_dqo": GluonBwdConfig(block_m=64, num_stages=2, consumer_regs=240, loader_regs=24, dq_overlap=True),
        "m64_s2_oc": GluonBwdConfig(block_m=64, num_stages=2, consumer_regs=240, loader_regs=24,
                                    overlap_convert=True),
        "m64_s2_oc_hf": GluonBwdConfig(block_m=64, num_stages=2, overlap_convert=True, heads_first=True),
    },
}

GLUON_CANDIDATES = {FWD_GLUON: _GLUON_FWD_CANDIDATES, BWD_GLUON: _GLUON_BWD_CANDIDATES}


# Set by :func:`override` (tuning scripts, experiments): {kernel: config}.
_OVERRIDES: dict = {}


@contextlib.contextmanager
def override(**configs: KernelConfig):
    """Within the block, launch the named kernels with the given configs, e.g.
    ``with override(bwd_dkdv=KernelConfig(block_m=32, block_n=128, num_warps=8)): ...``. Overriding ``fwd``
    forces the portable forward; ``fwd_gluon=None`` turns the Hopper forward off."""
    unknown = set(configs) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernel names {sorted(unknown)}; expected one of {', '.join(KERNELS)}")
    previous = dict(_OVERRIDES)
    _OVERRIDES.update(configs)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(previous)


def overridden(kernel: str) -> bool:
    """Whether :func:`override` set ``kernel``'s config."""
    return kernel in _OVERRIDES


def any_overridden() -> bool:
    """Whether an :func:`override` block is active (launch plans are not used inside one)."""
    return bool(_OVERRIDES)


def packed_gqa_config(arch: str, head_dim: int, table: GluonFwdConfig) -> GluonFwdConfig:
    """The Hopper forward's config for GQA groups packed as rows (_PACKED_GQA_GLUON_FWD) at this padded
    head dim, else ``table`` (the dense table's, which an override of FWD_GLUON also sets)."""
    if FWD_GLUON in _OVERRIDES:
        return table
    return _PACKED_GQA_GLUON_FWD.get(arch, {}).get(head_dim, table)


def get_config(kernel: str, arch: str, head_dim: int, causal: bool = False, seqlen_k: int = 0,
               dtype: Optional[torch.dtype] = None, varlen: bool = False, paged: bool = False) -> Optional[Config]:
    """The config for ``kernel`` on ``arch`` ('sm90', 'interpreter', ...) for these shapes
    (``varlen``: a packed batch; ``seqlen_k`` is then its longest sequence's; ``paged``: keys read
    through a block table).

    Order: :func:`override`, then the tuned table of ``arch``, then the portable defaults.
    None: the kernel does not serve these shapes.
    """
    if kernel in _OVERRIDES:
        return _OVERRIDES[kernel]
    return table_config(kernel, arch, head_dim, causal, seqlen_k, dtype, varlen, paged)


@functools.lru_cache(maxsize=4096)  # the tables are constant; called on every attention call
def table_config(kernel: str, arch: str, head_dim: int, causal: bool = False, seqlen_k: int = 0,
                 dtype: Optional[torch.dtype] = None, varlen: bool = False, paged: bool = False) -> Optional[Config]:
    """The committed tables alone (no override)."""
    if arch == "interpreter":
        return _INTERPRETER[kernel]
    for table in (_TUNED.get(arch, {}).get(kernel), _DEFAULT_GPU[kernel]):
        for rule in table or ():
            if rule.matches(head_dim, causal, seqlen_k, dtype, varlen, paged):
                return rule.config
    if kernel in (FWD_GLUON, BWD_GLUON):
        return None
    raise ValueError(f"no {kernel} config for head dim {head_dim} on {arch}")
