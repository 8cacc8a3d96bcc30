"""Block masks: which tiles of a mask_mod's attention matrix are empty, partial or full, worked out
once so that the kernels skip the empty tiles and evaluate the mask only on the partial ones.

``create_block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k)`` runs the mask over every
position once (a kernel per block of ``block_size`` queries x keys) and keeps, for each block row,
the lists of its partial and full blocks; and the same seen from the keys, for the backward's
dK/dV kernel. A mask is reusable across calls and layers of the same sizes. ``batch`` or
``nheads`` None: one mask for all (the mask_mod then sees batch 0 / head 0 while it is built).
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import torch

from . import checks
from .kernels.portable.launch import block_mask_classes
from .options import MaskMod
from .triton_compat import is_jit_function

EMPTY, PARTIAL, FULL = 0, 1, 2


def _block_lists(classes: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """(partial count, partial block indices, full count, full block indices) of each row of
    ``classes`` (..., rows, blocks): counts int32 (..., rows), indices int32 (..., rows, blocks), a
    row's listed blocks first, in increasing order."""
    lists = []
    for kind in (PARTIAL, FULL):
        hits = classes == kind
        lists.append(hits.sum(-1, dtype=torch.int32))
        # A stable sort of "not this kind" puts this kind's blocks first, in order.
        lists.append(torch.argsort((~hits).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous())
    return tuple(lists)


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask_mod's blocks, classified (see the module docstring). Pass as ``block_mask=``.

    classes: int8 (batch or 1, nheads or 1, query blocks, key blocks), 0 empty / 1 partial / 2 full.
    query_lists / key_lists: _block_lists of classes and of its transpose (packed calls use them)."""

    mask_mod: object
    aux_tensors: tuple
    batch: Optional[int]
    nheads: Optional[int]
    seqlen_q: int
    seqlen_k: int
    block_size: Tuple[int, int]
    classes: torch.Tensor
    query_lists: tuple
    key_lists: tuple
    # Dense calls' lists by band (window_left, window_right): classes_in_band's, made once per band.
    by_band: dict = field(default_factory=dict, repr=False)
    native: Optional[dict] = None  # the MaskMod's it was built from (options.MaskMod)

    def sparsity(self) -> float:
        """The fraction of blocks the kernels skip (empty ones)."""
        return float((self.classes == EMPTY).float().mean()) if self.classes.numel() else 0.0

    def check_call(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, device: torch.device) -> None:
        """Raise unless this mask was built for a call of these sizes (on ``device``)."""
        built = (self.batch, self.nheads, self.seqlen_q, self.seqlen_k)
        for name, mine, call in zip(("batch", "nheads", "seqlen_q", "seqlen_k"), built,
                                    (batch, nheads, seqlen_q, seqlen_k)):
            if mine is not None and mine != call:
                raise ValueError(f"block_mask was built for {name}={mine}, but the call has {name}={call} "
                                 f"(create_block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k) with the call's "
                                 f"sizes; batch / nheads may be None to broadcast; packed calls: the number of "
                                 f"sequences and max_seqlen_q / max_seqlen_k)")
        if self.classes.device != device:
            raise ValueError(f"block_mask is on {self.classes.device} but q is on {device}")

    def kernel_args(self, by_keys: bool, band: Optional[Tuple[int, int]]) -> dict:
        """The portable kernels' block-list arguments: by query block (forward, dQ) or by key block
        (dK/dV). A broadcast batch or head has stride 0. ``band``: a dense call's (window_left,
        window_right), -1 unbounded, folded into the lists with the sequence ends (classes_in_band),
        so that full tiles need no element mask; None for packed calls, whose sequences end anywhere
        (their full tiles get the element masks, the mask_mod aside)."""
        if band is None:
            lists = self.key_lists if by_keys else self.query_lists
        else:
            if band not in self.by_band:
                classes = self.classes_in_band(*band)
                self.by_band[band] = (_block_lists(classes), _block_lists(classes.transpose(-1, -2)))
            lists = self.by_band[band][1 if by_keys else 0]
        count = lists[0]
        return dict(BlockLists=lists, stride_lists_b=count.stride(0) if count.shape[0] > 1 else 0,
                    stride_lists_h=count.stride(1) if count.shape[1] > 1 else 0, list_width=lists[1].shape[-1],
                    MASK_BLOCK_M=self.block_size[0], MASK_BLOCK_N=self.block_size[1],
                    FULL_TILES_MASKED=band is None)

    def classes_in_band(self, window_left: int, window_right: int) -> torch.Tensor:
        """The classes of a dense call with this band (flash_attn's, bottom-right aligned; causal is
        right = 0): empty where the mask or the band keeps nothing, full only where both keep all
        of a block that lies wholly inside the sequences, partial otherwise."""
        block_q, block_k = self.block_size
        num_q, num_k = self.classes.shape[-2:]
        device = self.classes.device
        first_row = torch.arange(num_q, device=device)[:, None] * block_q
        first_col = torch.arange(num_k, device=device)[None, :] * block_k
        last_row = torch.clamp(first_row + block_q, max=self.seqlen_q) - 1
        last_col = torch.clamp(first_col + block_k, max=self.seqlen_k) - 1
        diag = self.seqlen_k - self.seqlen_q  # key j is visible to row i when j - i is in [diag - left, diag + right]
        empty = torch.zeros(num_q, num_k, dtype=torch.bool, device=device)
        full = (first_row + block_q <= self.seqlen_q) & (first_col + block_k <= self.seqlen_k)
        if window_right >= 0:
            empty |= first_col - last_row > diag + window_right
            full &= last_col - first_row <= diag + window_right
        if window_left >= 0:
            empty |= last_col - first_row < diag - window_left
            full &= first_col - last_row >= diag - window_left
        band = torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)
        return torch.minimum(self.classes, band).contiguous()


def create_block_mask(mask_mod, batch: Optional[int], nheads: Optional[int], seqlen_q: int, seqlen_k: int,
                      aux_tensors: Optional[Sequence[torch.Tensor]] = None, device=None,
                      block_size=128) -> BlockMask:
    """Classify the blocks of ``mask_mod`` (a ``@triton.jit`` function ``(batch, head, q_idx, kv_idx,
    aux) -> keep``, or a flashtile.mods.MaskMod) for calls of these sizes; see the module docstring.

    aux_tensors: the tensors the mask reads (a MaskMod brings its own). device: where the mask lives
    (default: the aux tensors' device, else the current CUDA device, else the CPU). block_size: an
    int or (query rows, keys), powers of two from 16 to 128 (the kernels' tiles divide them).

    Not inside a function that torch.compile traces: the mask runs on the device once, here; build it
    outside and pass it in (compiled calls take it as a constant, guarded by its identity)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("create_block_mask runs the mask_mod over every block once, eagerly: call it outside "
                           "the function torch.compile traces and pass the BlockMask in (it is reusable across "
                           "calls and layers of the same sizes)")
    native = None
    if isinstance(mask_mod, MaskMod):
        if aux_tensors is not None:
            raise ValueError("aux_tensors: a flashtile.mods.MaskMod carries its own aux tensors; pass one or the other")
        mask_mod, aux_tensors, native = mask_mod.fn, mask_mod.aux_tensors, mask_mod.native
    if not is_jit_function(mask_mod):
        raise TypeError(f"mask_mod must be a @triton.jit function (batch, head, q_idx, kv_idx, aux) -> keep, or a "
                        f"flashtile.mods.MaskMod, got {type(mask_mod).__name__}")
    block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for size in (block_q, block_k):
        if not isinstance(size, int) or size < 16 or size > 128 or size & (size - 1):
            raise ValueError(f"block_size must be a power of two from 16 to 128 (or a pair of them), got {block_size}")
    for name, value in (("batch", batch), ("nheads", nheads)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None (one mask for all), got {value!r}")
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    aux = tuple(aux_tensors or ())
    if device is None:
        device = aux[0].device if aux else (torch.device("cuda", torch.cuda.current_device())
                                            if torch.cuda.is_available() else torch.device("cpu"))
    device = torch.device(device)
    checks.check_aux_tensors(aux, device)
    classes = block_mask_classes(mask_mod, aux, batch or 1, nheads or 1, seqlen_q, seqlen_k, block_q, block_k,
                                 device)
    return BlockMask(mask_mod, aux, batch, nheads, seqlen_q, seqlen_k, (block_q, block_k), classes,
                     _block_lists(classes), _block_lists(classes.transpose(-1, -2)), native=native)
