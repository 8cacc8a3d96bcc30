"""Pure-PyTorch references for flashtile's kernels, shared by the tests and debug tools.

Both follow the flash_attn contract: q (b, sq, h, d), k/v (b, sk, hk, d); scores
``q.k * scale`` -> softcap -> ALiBi bias -> causal/window mask (bottom-right aligned)
-> softmax -> dropout -> @ v. They return ``(out, lse)`` with lse (b, h, sq), natural log;
a row with no visible key gets out = 0 and lse = -inf.

- :func:`attention_naive` materializes the scores (reads like the definition; use float64
  for ground truth, or the input dtype to see what plain PyTorch gets in that dtype).
- :func:`attention_blockwise` runs the FlashAttention algorithm tile by tile (online
  softmax, skipped blocks) in float32: the kernels' algorithm in readable form.
"""

import math
from typing import Optional, Tuple

import torch


def visible_keys_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal: bool = False,
                      device=None) -> torch.Tensor:
    """Boolean (sq, sk): True where query i may attend to key j.

    Query i lines up with key i + sk - sq; a window (left, right) keeps keys within
    [i + sk - sq - left, i + sk - sq + right], -1 meaning unbounded; causal is right = 0.
    """
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= cols <= rows + right
    if left >= 0:
        keep &= cols >= rows - left
    return keep


def alibi_bias(alibi_slopes: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """(b, h, sq, sk) bias ``-slope * |i + sk - sq - j|`` from slopes (h,) or (b, h)."""
    slopes = alibi_slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.expand(batch, -1)
    rows = torch.arange(seqlen_q, device=slopes.device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (rows - cols).abs().to(dtype)
    return -slopes[:, :, None, None] * distance


def _expand_kv_heads(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """GQA: query head i uses kv head i // (nheads // nheads_k)."""
    return x.repeat_interleave(nheads // x.shape[2], dim=2)


def attention_scores(q, k, softmax_scale=None, softcap: float = 0.0, alibi_slopes=None, dtype=torch.float64):
    """Scaled, capped and biased scores (b, h, sq, sk) in ``dtype``, before masking (GQA: query
    head i reads kv head i // (h / hk))."""
    batch, seqlen_q, nheads, head_dim = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    k = _expand_kv_heads(k, nheads)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k.to(dtype)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, batch, seqlen_q, k.shape[1], dtype)
    return s


def attention_naive(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                    dropout_mask: Optional[torch.Tensor] = None,
                    dtype: Optional[torch.dtype] = torch.float64,
                    learnable_sink: Optional[torch.Tensor] = None, score_mod=None,
                    mask_mod=None, attn_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention by the definition, computed in ``dtype`` (None: the input dtype).

    dropout_mask: boolean (b, h, sq, sk), True = kept, applied with scale 1/(1-p);
    dropout is only applied when it is given (the kernels' mask comes from their RNG).
    learnable_sink: (h,) logits, one more column of every row's softmax, with no value.
    score_mod / mask_mod: PyTorch twins of the kernels' mods (flashtile.mods), called on the whole
    matrix: ``score_mod(scores (b, h, sq, sk), b_idx, h_idx, q_idx, kv_idx)`` and ``mask_mod(b_idx,
    h_idx, q_idx, kv_idx) -> keep``, with broadcastable index tensors (b, 1, 1, 1), (1, h, 1, 1),
    (sq, 1), (1, sk).
    attn_bias: broadcastable to (b, h, sq, sk), added to the scores after softcap and ALiBi.
    Differentiable: gradients through it are the reference gradients.
    """
    dtype = dtype or q.dtype
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    s = attention_scores(q, k, softmax_scale, softcap, alibi_slopes, dtype)
    if attn_bias is not None:
        s = s + attn_bias.to(dtype)
    keep = visible_keys_mask(seqlen_q, seqlen_k, window_size, causal, device=q.device)
    if score_mod is not None or mask_mod is not None:
        index = (torch.arange(s.shape[0], device=q.device)[:, None, None, None],
                 torch.arange(s.shape[1], device=q.device)[None, :, None, None],
                 torch.arange(seqlen_q, device=q.device)[:, None], torch.arange(seqlen_k, device=q.device)[None, :])
        if score_mod is not None:
            s = score_mod(s, *index)
        if mask_mod is not None:
            keep = keep & mask_mod(*index)
    s = s.masked_fill(~keep, float("-inf"))
    if learnable_sink is not None:
        sink_column = learnable_sink.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        s = torch.cat([s, sink_column], dim=-1)
    lse = torch.logsumexp(s.float() if dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0, not NaN
    if learnable_sink is not None:
        p = p[..., :-1]
    if dropout_mask is not None:
        p = p.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv_heads(v, q.shape[2]).to(dtype))
    return out, lse


def online_softmax_step(m, l, acc, scores, v_block):
    """One key block of FlashAttention's online softmax: the running row max ``m`` and sum ``l``
    (b, h, rows) and the unnormalised accumulator ``acc`` (b, h, rows, d), updated with the block's
    scores (b, h, rows, n; -inf where masked) and values (b, n, h, d). A row that has seen no key
    keeps m = -inf, l = 0. Returns the new (m, l, acc)."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # no key seen yet: keep exp() finite
    p = torch.exp(scores - m_safe[..., None])
    alpha = torch.exp(m - m_safe)
    return m_new, l * alpha + p.sum(dim=-1), acc * alpha[..., None] + torch.einsum("bhqk,bkhd->bhqd", p, v_block)


def online_softmax_result(m, l, acc):
    """(out (b, h, rows, d), lse (b, h, rows)) from the online softmax's state: acc / l and
    m + log(l); a row without keys gives out 0 and lse -inf."""
    empty = l == 0
    l_safe = l.masked_fill(empty, 1.0)
    return acc / l_safe[..., None], (m + torch.log(l_safe)).masked_fill(empty, float("-inf"))


def attention_blockwise(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                        window_size=(-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[torch.Tensor] = None,
                        block_m: int = 64, block_n: int = 64,
                        dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """The FlashAttention-2 forward, one (query block, key block) tile at a time.

    Keeps only a running max ``m``, sum ``l`` and accumulator per query row, and skips
    key blocks that lie wholly outside the causal/window band, as the kernels do.
    No dropout (that needs the kernels' RNG).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    left, right = window_size
    if causal:
        right = 0
    diag = seqlen_k - seqlen_q
    out = torch.zeros(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=q.device)
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=dtype, device=q.device)
    keep_all = visible_keys_mask(seqlen_q, seqlen_k, (left, right), device=q.device)
    v_full = _expand_kv_heads(v, nheads).to(dtype)
    bias = alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, dtype) if alibi_slopes is not None else None
    for m0 in range(0, seqlen_q, block_m):
        m1 = min(m0 + block_m, seqlen_q)
        m_i = torch.full((batch, nheads, m1 - m0), float("-inf"), dtype=dtype, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(batch, nheads, m1 - m0, head_dim, dtype=dtype, device=q.device)
        # The band of keys this block of rows can see; blocks outside it are skipped.
        lo = max(m0 + diag - left, 0) if left >= 0 else 0
        hi = min(m1 - 1 + diag + right + 1, seqlen_k) if right >= 0 else seqlen_k
        for n0 in range((lo // block_n) * block_n, max(hi, 0), block_n):
            n1 = min(n0 + block_n, seqlen_k)
            s = attention_scores(q[:, m0:m1], k[:, n0:n1], softmax_scale, softcap, None, dtype)
            if bias is not None:
                s = s + bias[:, :, m0:m1, n0:n1]
            s = s.masked_fill(~keep_all[m0:m1, n0:n1], float("-inf"))
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v_full[:, n0:n1])
        block_out, lse[:, :, m0:m1] = online_softmax_result(m_i, l_i, acc)
        out[:, m0:m1] = block_out.transpose(1, 2)
    return out, lse


def _mods_of_sequence(options: dict, b: int, used_q: int, used_k: int) -> dict:
    """``options`` with score_mod / mask_mod seeing sequence ``b`` of a packed batch as their batch
    index (attention_naive runs it alone, as batch 0), and attn_bias's corner of sequence b."""
    options = dict(options)
    score_mod, mask_mod = options.get("score_mod"), options.get("mask_mod")
    bias = options.get("attn_bias")
    if bias is not None:  # broadcastable to (batch, h, max_seqlen_q, max_seqlen_k): sequence b's corner
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        options["attn_bias"] = bias[b if bias.shape[0] > 1 else 0][None, :, :used_q, :used_k]
    if score_mod is not None:
        options["score_mod"] = lambda s, b_idx, *index: score_mod(s, b_idx + b, *index)
    if mask_mod is not None:
        options["mask_mod"] = lambda b_idx, *index: mask_mod(b_idx + b, *index)
    return options


def attention_varlen_naive(q, k, v, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
                           alibi_slopes: Optional[torch.Tensor] = None, dropout_mask: Optional[torch.Tensor] = None,
                           **options) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_naive` on each sequence of a packed batch, alone.

    q (total_q, h, d), k/v (total_k, hk, d); cu_seqlens (batch + 1,); seqused (batch,) or None.
    alibi_slopes (h,) or (batch, h); dropout_mask (batch, h, max_seqlen_q, max_seqlen_k).
    Returns out (total_q, h, d) and lse (h, total_q); rows past seqused_q get 0 and -inf (the sink's
    logit with a learnable_sink).
    """
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dtype = options.get("dtype", torch.float64) or q.dtype
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        reserved_q = cu_q[b + 1] - cu_q[b]
        used_q = reserved_q if seqused_q is None else int(seqused_q[b])
        used_k = cu_k[b + 1] - cu_k[b] if seqused_k is None else int(seqused_k[b])
        q_b = q[cu_q[b]:cu_q[b] + used_q].unsqueeze(0)
        k_b = k[cu_k[b]:cu_k[b] + used_k].unsqueeze(0)
        v_b = v[cu_k[b]:cu_k[b] + used_k].unsqueeze(0)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        mask = None if dropout_mask is None else dropout_mask[b:b + 1, :, :used_q, :used_k]
        out_b, lse_b = attention_naive(q_b, k_b, v_b, alibi_slopes=slopes, dropout_mask=mask,
                                       **_mods_of_sequence(options, b, used_q, used_k))
        outs.append(out_b[0])
        lses.append(lse_b[0])
        if used_q < reserved_q:
            outs.append(out_b.new_zeros((reserved_q - used_q,) + tuple(out_b.shape[2:])))
            unused = lse_b.new_full((lse_b.shape[1], reserved_q - used_q), float("-inf"))
            if options.get("learnable_sink") is not None:
                unused = options["learnable_sink"].to(unused.dtype)[:, None].expand_as(unused)
            lses.append(unused)
    if not outs:
        return q.new_zeros(q.shape, dtype=dtype), q.new_zeros((q.shape[1], 0), dtype=torch.float32)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotary embedding by the definition: x (b, s, h, d) rotated at ``positions`` (b, s) by
    the first 2 * cos.shape[1] channels.

    interleaved: channel pairs (0, 1), (2, 3), ... rotate together (GPT-J); otherwise the two
    halves of the rotary channels do (GPT-NeoX). Computed in float32, returned in x's dtype.
    """
    half = cos.shape[1]
    cos_p = cos[positions].unsqueeze(2).float()  # (b, s, 1, half)
    sin_p = sin[positions].unsqueeze(2).float()
    rot, rest = x[..., :2 * half].float(), x[..., 2 * half:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos_p - x2 * sin_p, x1 * sin_p + x2 * cos_p], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * cos_p - x2 * sin_p, x1 * sin_p + x2 * cos_p], dim=-1)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)
