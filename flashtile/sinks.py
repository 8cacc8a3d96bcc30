"""Learnable attention sinks (gpt-oss): a logit per query head that joins every row's softmax with
no value attached, so a row may give part of its weight to nothing.

With the sink s_h, row i's probabilities are exp(S_ij - L_i) over its keys and exp(s_h - L_i) for
the sink, where L_i = logaddexp(lse_i, s_h) and lse_i is the row's logsumexp without the sink. The
forward kernels take the sink in as one more key with no value (kernels/portable/sink.py,
kernels/hopper/sink.py) and return out and L. The backward kernels on that out and L are exact for
the keys (the sink adds nothing to O, so delta_i = rowsum(dO_i * O_i) is unchanged), and the sink's
gradient, -sum_i exp(s_h - L_i) delta_i over the rows of head h, comes from the backward's preprocess,
which has delta. A row that sees no key gets out 0 and lse = s_h. This module checks the argument."""

from typing import Optional

import torch


def check_learnable_sink(learnable_sink, nheads: int, device: torch.device) -> None:
    """Raise unless ``learnable_sink`` is a floating-point (nheads,) tensor on ``device``."""
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor of shape ({nheads},) or None, got "
                        f"{type(learnable_sink).__name__}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},): one logit per query head, got "
                         f"{tuple(learnable_sink.shape)}")
    if not learnable_sink.is_floating_point():
        raise ValueError(f"learnable_sink must be a floating-point tensor, got {learnable_sink.dtype}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink is on {learnable_sink.device} but q is on {device}")


def unused_rows_lse(shape: tuple, learnable_sink: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A packed call's float32 lse (nheads, total_q) for rows past seqused_q, which the kernels leave
    alone: -inf (no key), or each head's sink logit with a learnable sink."""
    if learnable_sink is None:
        return torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
    return learnable_sink.detach().to(torch.float32)[:, None].expand(shape).contiguous()


def sink_grad_buffer(learnable_sink: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The float32 (nheads,) buffer a backward with a learnable sink writes the sink's gradient into
    (None without a sink)."""
    if learnable_sink is None:
        return None
    return torch.empty(learnable_sink.shape, dtype=torch.float32, device=learnable_sink.device)


def sink_grad_for(learnable_sink: Optional[torch.Tensor], dsink: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sink's gradient in the sink's dtype (None without a sink)."""
    return None if dsink is None else dsink.to(learnable_sink.dtype)
