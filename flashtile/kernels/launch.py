"""Launchers: turn tensors and attention options into kernel arguments and grids.

Tensors arrive as (batch, seqlen, heads, head_dim) views with a unit-stride last dim;
outputs are preallocated by the caller, so packed layouts (qkv, kv) and their
gradients are written in place without copies.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from ..configs import BWD_DKDV, BWD_DQ, FWD, get_config, padded_head_dim
from ..runtime import arch_of, empty
from .backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .forward import attn_fwd_kernel
from .probs import attn_probs_kernel

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class ScoreParams:
    """Everything that shapes the scores, shared by forward, backward and probs.

    window_left / window_right: -1 means unbounded; causal is window_right = 0.
    alibi_slopes: fp32 (nheads,) or (batch, nheads), or None.
    dropout_seed: int64 tensor of one element on the inputs' device, or None.
    """

    softmax_scale: float
    softcap: float = 0.0
    window_left: int = -1
    window_right: int = -1
    alibi_slopes: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    dropout_seed: Optional[torch.Tensor] = None

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


def _bsh_strides(t: torch.Tensor) -> tuple:
    """(batch, seqlen, head) strides of a (b, s, h, d) tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _shape_args(q: torch.Tensor, k: torch.Tensor) -> dict:
    batch, seqlen_q, nheads, head_dim = q.shape
    return dict(nheads=nheads, head_group=nheads // k.shape[2], seqlen_q=seqlen_q, seqlen_k=k.shape[1],
                HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim))


def attention_forward(q, k, v, out, lse, params: ScoreParams) -> None:
    """out (b, sq, h, d) <- attention; lse (b, h, sq) float32 <- natural-log logsumexp."""
    batch, seqlen_q, nheads, head_dim = q.shape
    if out.numel() == 0:
        return
    cfg = get_config(FWD, arch_of(q.device), head_dim)
    grid = (triton.cdiv(seqlen_q, cfg.block_m), nheads, batch)
    attn_fwd_kernel[grid](
        q, k, v, out, lse,
        *_bsh_strides(q), *_bsh_strides(k), *_bsh_strides(v), *_bsh_strides(out),
        lse.stride(0), lse.stride(1),
        **_shape_args(q, k), **params.kernel_args(q.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch_kwargs(),
    )


def attention_backward(q, k, v, out, dout, lse, dq, dk, dv, params: ScoreParams) -> None:
    """dq, dk, dv <- gradients of the attention whose forward gave ``out`` and ``lse``."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if dq.numel() == 0 and dk.numel() == 0:
        return
    if dq.numel() == 0 or seqlen_q == 0:
        # No query attends: the keys and values got no gradient.
        dk.zero_()
        dv.zero_()
        return
    arch = arch_of(q.device)
    shape = _shape_args(q, k)
    score = params.kernel_args(q.dtype)

    delta = torch.empty((batch, nheads, seqlen_q), device=q.device, dtype=torch.float32)
    lse_log2 = torch.empty_like(delta)
    pre_cfg = get_config(FWD, arch, head_dim)
    attn_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, pre_cfg.block_m), nheads, batch)](
        out, dout, lse, delta, lse_log2,
        *_bsh_strides(out), *_bsh_strides(dout), lse.stride(0), lse.stride(1),
        nheads, seqlen_q, HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"], BLOCK_M=pre_cfg.block_m,
    )
    common = (*_bsh_strides(q), *_bsh_strides(k), *_bsh_strides(v), *_bsh_strides(dout))

    if seqlen_k > 0:
        cfg = get_config(BWD_DKDV, arch, head_dim)
        attn_bwd_dkdv_kernel[(triton.cdiv(seqlen_k, cfg.block_n), nheads_k, batch)](
            q, k, v, dout, lse_log2, delta, dk, dv,
            *common, *_bsh_strides(dk), *_bsh_strides(dv),
            softmax_scale=params.softmax_scale, **shape, **score,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch_kwargs(),
        )
    cfg = get_config(BWD_DQ, arch, head_dim)
    attn_bwd_dq_kernel[(triton.cdiv(seqlen_q, cfg.block_m), nheads, batch)](
        q, k, v, dout, lse_log2, delta, dq,
        *common, *_bsh_strides(dq),
        softmax_scale=params.softmax_scale, **shape, **score,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch_kwargs(),
    )


def attention_probs(q, k, lse, params: ScoreParams, dtype: torch.dtype) -> torch.Tensor:
    """The full (b, h, sq, sk) probability matrix, dropped entries negated. N^2 memory."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    # The kernel writes every element (masked ones as 0), so no memset is needed.
    probs = empty((batch, nheads, seqlen_q, seqlen_k), dtype, q.device)
    if probs.numel() == 0:
        return probs
    cfg = get_config(FWD, arch_of(q.device), head_dim)
    attn_probs_kernel[(triton.cdiv(seqlen_q, cfg.block_m), nheads, batch)](
        q, k, lse, probs,
        *_bsh_strides(q), *_bsh_strides(k), lse.stride(0), lse.stride(1),
        probs.stride(0), probs.stride(1), probs.stride(2),
        **_shape_args(q, k), **params.kernel_args(q.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )
    return probs
