"""The built-in score and mask mods (flashtile/mods.py wraps them for users) and the block mask's
classification kernel. A score mod is ``(score, batch, head, q_idx, kv_idx, aux) -> score`` in
natural units, its backward ``(grad, score, batch, head, q_idx, kv_idx, aux) -> grad`` of the mod's
input; a mask mod is ``(batch, head, q_idx, kv_idx, aux) -> keep`` (scores.py calls them)."""

import triton
import triton.language as tl

from .scores import mod_positions, tanh


@triton.jit
def alibi_score(score, b, h, q_idx, kv_idx, aux):
    """aux = (slopes,): float32 (nheads,); adds -slope[h] * |q_idx - kv_idx|."""
    distance = tl.abs(q_idx - kv_idx).to(tl.float32)
    return score - tl.load(aux[0] + h) * distance


@triton.jit
def additive_bwd(grad, score, b, h, q_idx, kv_idx, aux):
    """The backward of a mod that adds a constant to the score: the gradient passes unchanged."""
    return grad


@triton.jit
def softcap_score(score, b, h, q_idx, kv_idx, aux):
    """aux = (cap,): float32 (1,); cap * tanh(score / cap)."""
    cap = tl.load(aux[0])
    return cap * tanh(score / cap)


@triton.jit
def softcap_bwd(grad, score, b, h, q_idx, kv_idx, aux):
    t = tanh(score / tl.load(aux[0]))
    return grad * (1.0 - t * t)


@triton.jit
def relative_bias_score(score, b, h, q_idx, kv_idx, aux):
    """aux = (table, max_distance): float32 (nheads, 2 * D + 1), int32 (1,) holding D; adds
    table[h, clamp(kv_idx - q_idx, -D, D) + D]."""
    max_distance = tl.load(aux[1])
    offset = tl.minimum(tl.maximum(kv_idx - q_idx, -max_distance), max_distance) + max_distance
    return score + tl.load(aux[0] + h * (2 * max_distance + 1) + offset)


# attn_bias: aux = (bias, stride_b, stride_h, stride_q, grad, grad_stride_b, grad_stride_h, grad_stride_q):
# the bias and the backward's float32 accumulator of its gradient, with their strides as ints (0 along
# broadcast dimensions), which the launch specializes like any int argument (divisible by 16, ...).
# Both have key stride 1 unless broadcast over keys: the key positions enter unscaled, so that in the
# kernels' unmasked tiles, where they are not clamped, the compiler sees them contiguous and aligned
# and vectorizes the loads and atomics along them.

@triton.jit
def _head_offset(b, h, aux, first: tl.constexpr):
    """Offset of (b, h) in aux[first] by its strides aux[first + 1:first + 3] (64-bit: a bias of many
    long sequences outgrows 32 bits)."""
    return b.to(tl.int64) * aux[first + 1] + h.to(tl.int64) * aux[first + 2]


@triton.jit
def _row_offsets(b, h, q_idx, aux, first: tl.constexpr):
    return _head_offset(b, h, aux, first) + q_idx.to(tl.int64) * aux[first + 3]


@triton.jit
def attn_bias_score(score, b, h, q_idx, kv_idx, aux):
    """Adds bias[b, h, q_idx, kv_idx] (any float dtype)."""
    return score + tl.load(aux[0] + (_row_offsets(b, h, q_idx, aux, 0) + kv_idx)).to(tl.float32)


@triton.jit
def attn_bias_score_keys_broadcast(score, b, h, q_idx, kv_idx, aux):
    """Adds bias[b, h, q_idx, 0]: a bias of one key."""
    return score + tl.load(aux[0] + _row_offsets(b, h, q_idx, aux, 0)).to(tl.float32)


# The dQ kernel's backward of attn_bias: the bias's gradient is the score's, added into aux[4] once per
# score there (the dK/dV kernel takes additive_bwd). Its tiles are queries x keys. A gradient broadcast
# over queries or keys is summed along that axis first, so that one atomic add carries a line of the
# tile. Positions past a sequence's end are clamped onto its last one, where the gradient is exactly 0.

@triton.jit
def attn_bias_grad_store(grad, score, b, h, q_idx, kv_idx, aux):
    """A gradient of the call's full (batch, nheads, seqlen_q, seqlen_k) shape: one score per element,
    so a store, no atomic, and no float32 accumulator to convert afterwards. A clamped position
    shares its address with the last one and has a gradient of exactly 0: zeros store nothing (the
    buffer starts at zeros), so they never overwrite the last position's."""
    tl.store(aux[4] + (_row_offsets(b, h, q_idx, aux, 4) + kv_idx), grad.to(aux[4].dtype.element_ty),
             mask=grad != 0.0)
    return grad


@triton.jit
def attn_bias_grad(grad, score, b, h, q_idx, kv_idx, aux):
    tl.atomic_add(aux[4] + (_row_offsets(b, h, q_idx, aux, 4) + kv_idx), grad, sem="relaxed")
    return grad


@triton.jit
def attn_bias_grad_sum_queries(grad, score, b, h, q_idx, kv_idx, aux):
    tl.atomic_add(aux[4] + (_head_offset(b, h, aux, 4) + tl.sum(kv_idx, 0)), tl.sum(grad, 0), sem="relaxed")
    return grad


@triton.jit
def attn_bias_grad_sum_keys(grad, score, b, h, q_idx, kv_idx, aux):
    tl.atomic_add(aux[4] + tl.sum(_row_offsets(b, h, q_idx, aux, 4), 1), tl.sum(grad, 1), sem="relaxed")
    return grad


@triton.jit
def attn_bias_grad_sum_tile(grad, score, b, h, q_idx, kv_idx, aux):
    tl.atomic_add(aux[4] + _head_offset(b, h, aux, 4), tl.sum(tl.sum(grad, 1), 0), sem="relaxed")
    return grad


@triton.jit
def document_mask(b, h, q_idx, kv_idx, aux):
    """aux = (document_ids,): int32 (seqlen,), the document of each position (packed documents in
    one sequence, queries and keys alike); a query sees the keys of its own document."""
    return tl.load(aux[0] + q_idx) == tl.load(aux[0] + kv_idx)


@triton.jit
def sliding_window_mask(b, h, q_idx, kv_idx, aux):
    """aux = (window,): int32 (2,) holding (left, right); a query sees keys q - left .. q + right
    (raw positions)."""
    distance = q_idx - kv_idx
    return (distance <= tl.load(aux[0])) & (-distance <= tl.load(aux[0] + 1))


@triton.jit
def block_mask_classes_kernel(
    Classes, stride_cb, stride_ch, stride_cq, nheads, seqlen_q, seqlen_k, MaskAux,
    MASK_MOD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, SUB_Q: tl.constexpr,
):
    """Classes[b, h, i, j] (int8) <- 0 where the mask keeps nothing of block (i, j) (BLOCK_Q query
    rows x BLOCK_K keys), 2 where it keeps every position inside the sequences, 1 otherwise. One
    program per block, for (batch, head) program id 2 = b * nheads + h."""
    q_block = tl.program_id(0)
    k_block = tl.program_id(1)
    b = tl.program_id(2) // nheads
    h = tl.program_id(2) % nheads
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    kept = 0
    inside = 0
    for sub in range(0, BLOCK_Q, SUB_Q):
        rows = q_block * BLOCK_Q + sub + tl.arange(0, SUB_Q)
        q_idx, kv_idx = mod_positions(rows, cols, seqlen_q, seqlen_k, False)
        in_range = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
        keep = MASK_MOD(b, h, q_idx, kv_idx, MaskAux) & in_range
        kept += tl.sum(keep.to(tl.int32))
        inside += tl.sum(in_range.to(tl.int32))
    cls = tl.where(kept == 0, 0, tl.where(kept == inside, 2, 1))
    tl.store(Classes + b * stride_cb + h * stride_ch + q_block * stride_cq + k_block, cls.to(tl.int8))
