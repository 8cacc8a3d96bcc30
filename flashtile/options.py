"""What a call asks for, resolved once at the public boundary: the score options (scale, softcap,
window / causal, ALiBi, dropout) as one :class:`ScoreParams`, and where the sequences of a packed
batch live (:class:`PackedSeqs`). The dispatcher and every launcher take these two objects.

Between the public functions and the dispatcher sit the torch custom ops (flashtile/ops.py), whose
schemas take only tensors and lists of floats and ints: :func:`ScoreParams.op_args` flattens the
options for them and :func:`ScoreParams.from_op_args` rebuilds them on the other side.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from . import checks

_LOG2E = math.log2(math.e)


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score mod with its derivative and the tensors it reads (flashtile.mods builds the common
    ones): ``fn(score, batch, head, q_idx, kv_idx, aux)`` and ``bwd(grad, score, batch, head, q_idx,
    kv_idx, aux)``, both ``@triton.jit``, aux the tuple ``aux_tensors``."""

    fn: object
    bwd: Optional[object] = None
    aux_tensors: tuple = ()
    # The same scores as one of flash_attn's options ({"softcap": c}, or {"alibi_slopes": s} when
    # queries and keys line up), which the Hopper kernels compute: flashtile.mods.native_options.
    native: Optional[dict] = None
    native_needs_aligned: bool = False


@dataclass(frozen=True, eq=False)
class MaskMod:
    """A mask mod and the tensors it reads: ``fn(batch, head, q_idx, kv_idx, aux) -> keep``."""

    fn: object
    aux_tensors: tuple = ()
    # The same mask as flash_attn's option ({"window_size": (left, right)}) where queries and keys line
    # up (raw positions are then bottom-right ones), which the Hopper kernels compute: mods.native_window.
    native: Optional[dict] = None


@dataclass(frozen=True, eq=False)
class Mods:
    """A call's programmable attention (flashtile/mods.py, block_mask.py): the user's ``@triton.jit``
    score_mod (and its backward) and mask_mod, the tuples of tensors each reads, and an optional
    block mask. Only the portable kernels take them; no launch plan keeps them (the aux tensors
    are bound into the launch)."""

    score_mod: Optional[object] = None
    score_mod_bwd: Optional[object] = None
    mask_mod: Optional[object] = None
    score_aux: tuple = ()
    mask_aux: tuple = ()
    block_mask: Optional[object] = None  # block_mask.BlockMask
    attn_bias: Optional["AttnBias"] = None  # then score_mod adds it
    # The dQ kernel's score_mod_bwd and its aux, where they differ from the dK/dV kernel's: an attn_bias
    # gradient is accumulated there (AttnBias.backward_mods).
    dq_score_mod_bwd: Optional[object] = None
    dq_score_aux: Optional[tuple] = None
    # The table of flashtile.mods.relative_bias when it is the only mod: the Hopper forward adds it
    # itself (dispatch.hopper_takes; kernels/hopper/scores.relative_bias_log2).
    relative_bias_table: Optional[torch.Tensor] = None

    def names(self) -> List[str]:
        """The mods set, by argument name (for the dispatcher's explanations)."""
        score_mod = "attn_bias" if self.attn_bias is not None else "score_mod"
        return [name for name, value in ((score_mod, self.score_mod), ("mask_mod", self.mask_mod),
                                         ("block_mask", self.block_mask)) if value is not None]

    def kernel_args(self, kernel: str, band: Optional[Tuple[int, int]]) -> dict:
        """The portable kernels' arguments for these mods: ``kernel`` is "fwd", "dq", "dkdv" (these
        take the block mask's lists, by query block or by key block) or "probs". ``band``: a dense
        call's (window_left, window_right), None for packed calls (BlockMask.kernel_args)."""
        args = dict(SCORE_MOD=self.score_mod, MASK_MOD=self.mask_mod, ScoreAux=self.score_aux,
                    MaskAux=self.mask_aux)
        if kernel in ("dq", "dkdv"):
            if self.score_mod is not None and self.score_mod_bwd is None:
                raise ValueError("a backward through score_mod needs score_mod_bwd, the derivative of the mod "
                                 "(score_mod_bwd(grad, score, batch, head, q_idx, kv_idx, aux) -> grad of the "
                                 "mod's input); the built-in mods of flashtile.mods carry theirs")
            args["SCORE_MOD_BWD"] = self.score_mod_bwd
            if kernel == "dq" and self.dq_score_mod_bwd is not None:
                args.update(SCORE_MOD_BWD=self.dq_score_mod_bwd, ScoreAux=self.dq_score_aux)
        if kernel != "probs" and self.block_mask is not None:
            args.update(self.block_mask.kernel_args(kernel == "dkdv", band))
        return args


@dataclass(frozen=True, eq=False)
class AttnBias:
    """A call's ``attn_bias`` (flashtile.mods.resolve_attn_bias checks it): ``tensor`` as given,
    ``read`` the tensor the kernels read (``tensor``, or a copy with unit key stride), ``strides``
    its batch, head and query strides as a (batch, nheads, seqlen_q, seqlen_k) tensor (0 along
    broadcast dimensions), ``grad_strides`` those of its gradient's buffer, of shape ``grad_shape``
    (the bias's, as four dimensions; the full broadcast shape for a deterministic backward, whose sums
    over broadcast dimensions then run in torch in a fixed order) and dtype ``grad_dtype`` (float32
    where the kernels or torch sum into it, else the bias's own). ``score_fn``: the score mod that adds
    it; ``grad_fn``: the dQ kernel's backward that adds or stores into the buffer (both
    kernels/portable/mods.py, which says what their aux holds)."""

    tensor: torch.Tensor
    read: torch.Tensor
    strides: Tuple[int, int, int]
    grad_strides: Tuple[int, int, int]
    grad_shape: Tuple[int, int, int, int]
    score_fn: object
    grad_fn: object
    grad_dtype: torch.dtype = torch.float32

    def forward_aux(self) -> tuple:
        """The mods' aux of the forward (the bias stands in for the accumulator it never reads)."""
        return (self.read, *self.strides, self.read, *self.strides)

    def backward_mods(self, mods: Mods) -> Tuple[Mods, torch.Tensor]:
        """(``mods`` with the dQ kernel adding or storing the bias's gradient into a fresh zeroed
        buffer, that buffer)."""
        grad = torch.zeros(self.grad_shape, dtype=self.grad_dtype, device=self.tensor.device)
        aux = (self.read, *self.strides, grad, *self.grad_strides)
        return dataclasses.replace(mods, dq_score_mod_bwd=self.grad_fn, dq_score_aux=aux), grad

    def grad(self, accumulated: torch.Tensor) -> torch.Tensor:
        """The bias's gradient, of its shape and dtype, from the accumulator backward_mods gave."""
        shape = (1,) * (4 - self.tensor.dim()) + tuple(self.tensor.shape)
        return accumulated.sum_to_size(shape).reshape(self.tensor.shape).to(self.tensor.dtype)


@dataclass(frozen=True)
class ScoreParams:
    """Everything that shapes the scores, shared by forward, backward and probs.

    window_left / window_right: -1 means unbounded; causal is window_right = 0.
    alibi_slopes: fp32 (nheads,) or (batch, nheads), or None.
    dropout_seed: int64 tensor of one element on the inputs' device, or None.
    learnable_sink: floating-point (nheads,) sink logits (unit stride), or None: not a score option, but
    the forward kernels take it into out and lse, and the backward gives its gradient (kernels/*/sink.py).
    """

    softmax_scale: float
    softcap: float = 0.0
    window_left: int = -1
    window_right: int = -1
    alibi_slopes: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    dropout_seed: Optional[torch.Tensor] = None
    mods: Optional[Mods] = None
    learnable_sink: Optional[torch.Tensor] = None

    @property
    def causal(self) -> bool:
        """Plain causal: the band is everything up to the diagonal (the config tables' key)."""
        return self.window_left < 0 and self.window_right == 0

    @property
    def scaled_dot_products(self) -> bool:
        """Scores are q.k times a positive scale (no softcap, no ALiBi), so the scale can
        be folded into exp2's multiply-add after the row max."""
        return (self.softcap == 0.0 and self.alibi_slopes is None and self.softmax_scale > 0
                and (self.mods is None or self.mods.score_mod is None))

    def with_mods(self, mods: Optional[Mods]) -> "ScoreParams":
        """These options with a call's score / mask mods (None: unchanged)."""
        return self if mods is None else dataclasses.replace(self, mods=mods)

    def mod_args(self, kernel: str, packed: bool) -> dict:
        """Mods.kernel_args, or nothing without mods (the kernels' defaults: no mods). ``packed``: a
        varlen call (the block mask's full tiles then keep their element masks)."""
        if self.mods is None:
            return {}
        return self.mods.kernel_args(kernel, None if packed else (self.window_left, self.window_right))

    def op_args(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], List[float], int, int]:
        """The options as the custom ops' schemas take them: (alibi_slopes, dropout_seed,
        [softmax_scale, softcap, dropout_p], window_left, window_right)."""
        return (self.alibi_slopes, self.dropout_seed, [self.softmax_scale, self.softcap, self.dropout_p],
                self.window_left, self.window_right)

    @classmethod
    def from_op_args(cls, alibi_slopes, dropout_seed, floats, window_left, window_right,
                     learnable_sink: Optional[torch.Tensor] = None) -> "ScoreParams":
        """The inverse of :meth:`op_args`, inside the ops (with the op's learnable sink, if any)."""
        softmax_scale, softcap, dropout_p = floats
        params = cls(softmax_scale=softmax_scale, softcap=softcap, window_left=window_left, window_right=window_right,
                     dropout_p=dropout_p)
        return params.with_tensors(alibi_slopes, dropout_seed if dropout_p > 0 else None).with_sink(learnable_sink)

    def with_sink(self, learnable_sink: Optional[torch.Tensor]) -> "ScoreParams":
        """These options with a call's learnable sink logits (given unit-stride to the kernels)."""
        if learnable_sink is None:
            return self
        return dataclasses.replace(self, learnable_sink=learnable_sink.detach().contiguous())

    def with_tensors(self, alibi_slopes: Optional[torch.Tensor],
                     dropout_seed: Optional[torch.Tensor] = None) -> "ScoreParams":
        """These options with a call's ALiBi slopes (given unit-stride to the kernels) and dropout seed."""
        if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:
            alibi_slopes = alibi_slopes.contiguous()  # (h,) or (b, h) floats: a trivial copy
        if alibi_slopes is self.alibi_slopes and dropout_seed is self.dropout_seed:
            return self
        return dataclasses.replace(self, alibi_slopes=alibi_slopes, dropout_seed=dropout_seed)

    def kernel_args(self, dtype: torch.dtype) -> dict:
        """Keyword arguments every attention kernel takes."""
        has_softcap = self.softcap > 0.0
        if has_softcap:
            qk_scale = self.softmax_scale / self.softcap
            softcap_log2 = self.softcap * _LOG2E
        else:
            qk_scale = self.softmax_scale * _LOG2E
            softcap_log2 = 0.0
        alibi = self.alibi_slopes
        return dict(
            AlibiSlopes=alibi,
            DropoutSeed=self.dropout_seed,
            stride_alibi_b=(alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0),
            qk_scale=qk_scale,
            softcap_log2=softcap_log2,
            window_left=max(self.window_left, 0),
            window_right=max(self.window_right, 0),
            dropout_p=self.dropout_p,
            HAS_LEFT=self.window_left >= 0,
            HAS_RIGHT=self.window_right >= 0,
            HAS_SOFTCAP=has_softcap,
            HAS_ALIBI=alibi is not None,
            HAS_DROPOUT=self.dropout_p > 0.0,
            # fp32 inputs get true fp32 products (tests compare against fp32/fp64);
            # 16-bit inputs ignore this.
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        )


@dataclass(frozen=True)
class PackedSeqs:
    """Where the sequences of a packed (varlen) batch live in the (total, h, d) tensors.

    cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) prefix sums on the tensors' device.
    max_seqlen_q / max_seqlen_k: host ints, at least every sequence's length (they size the grid).
    seqused_q / seqused_k: optional int32 (batch,): sequence b uses only its first seqused[b] tokens.
    block_table: optional int32 (batch, pages per sequence): K and V are then a paged cache
    (num_pages, page_size, hk, d) and key t of sequence b lives at page block_table[b, t // page_size]
    (forward only); cu_seqlens_k then only gives the key counts.
    Either cu_seqlens may be None (forward only): that side keeps its dense (b, s, h, d) layout,
    s rows per sequence of which seqused says how many are in use. A kv cache runs so: its queries
    are (batch, seqlen_q, ...) and its keys one cache row (or pages) per sequence, seqused_k long.
    """

    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_q: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    # With block_table: optional int32 (batch,), the position of each sequence's first key in its
    # pages (a kv cache's left padding).
    key_shift: Optional[torch.Tensor] = None
    # Without cu_seqlens and seqused (a dense batch run on the decode kernels): the sequences.
    dense_batch: Optional[int] = None

    @property
    def batch(self) -> int:
        for prefix_sums in (self.cu_seqlens_q, self.cu_seqlens_k):
            if prefix_sums is not None:
                return prefix_sums.shape[0] - 1
        if self.seqused_k is None:
            return self.dense_batch
        return self.seqused_k.shape[0]

    @property
    def paged(self) -> bool:
        return self.block_table is not None


def grid_lengths(q: torch.Tensor, k: torch.Tensor, seqs: Optional[PackedSeqs]) -> tuple:
    """(batch, seqlen_q, seqlen_k) the grid spans: the longest sequence when packed."""
    if seqs is None:
        return q.shape[0], q.shape[1], k.shape[1]
    return seqs.batch, seqs.max_seqlen_q, seqs.max_seqlen_k


def resolve_options(q: torch.Tensor, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    batch: Optional[int] = None, *, deterministic=False, return_attn_probs=False) -> ScoreParams:
    """Check the public options and flags and resolve them into one :class:`ScoreParams` (one place
    for every entry point): the default scale, causal as window_right = 0, a dropout seed drawn.
    q: (b, s, h, d) or (total, h, d); ``batch`` overrides b for packed batches. window_size: any
    pair of int-likes (checks.window_pair)."""
    nheads, head_dim = q.shape[-2], q.shape[-1]
    batch = q.shape[0] if batch is None else batch
    window_left, window_right = checks.check_options(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, batch=batch, nheads=nheads, device=q.device, deterministic=deterministic,
        return_attn_probs=return_attn_probs)
    dropout_seed = draw_dropout_seed(q.device) if dropout_p > 0 else None
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return ScoreParams(softmax_scale=scale, softcap=float(softcap), window_left=window_left,
                       window_right=0 if causal else window_right, alibi_slopes=alibi_slopes,
                       dropout_p=float(dropout_p), dropout_seed=dropout_seed)


def draw_dropout_seed(device: torch.device) -> torch.Tensor:
    """A call's dropout seed: drawn from the device's default generator outside the op (which stays a
    function of its inputs; the backward regenerates the mask from it), so torch.manual_seed makes
    it reproducible, and no host sync is needed (the kernels read it on the device)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def packed_seqs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, max_seqlen_q,
                max_seqlen_k) -> PackedSeqs:
    """A :class:`PackedSeqs` from the varlen ops' arguments (index tensors made contiguous)."""
    return PackedSeqs(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
                      None if seqused_q is None else seqused_q.contiguous(),
                      None if seqused_k is None else seqused_k.contiguous(), block_table)
