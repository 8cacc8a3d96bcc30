"""Learnable attention sinks (gpt-oss): a logit per query head that joins every row's softmax with
no value attached, so a row may give part of its weight to nothing.

With the sink s_h, row i's probabilities are exp(S_ij - L_i) over its keys and exp(s_h - L_i) for
the sink, where L_i = logaddexp(lse_i, s_h) and lse_i is the row's logsumexp without the sink. The
kernels compute out and lse without it; the sink then scales out by exp(lse_i - L_i) and replaces
lse by L. The kernels' backward run on that out and L is exact for the keys (the sink's column
adds nothing to O, so delta_i = rowsum(dO_i * O_i) is unchanged), and the sink's gradient is
-sum_i exp(s_h - L_i) delta_i over the rows of head h. A row that sees no key gets out 0 and
lse = s_h. These are a few elementwise passes over out and lse, outside the kernels."""

from typing import Tuple

import torch
from torch import Tensor


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


def _rows(t: Tensor) -> Tensor:
    """A (..., heads, rows) tensor of lse's layout as (..., rows, heads), out's order."""
    return t.movedim(-2, -1)


def add_sink(out: Tensor, lse: Tensor, sink: Tensor) -> Tuple[Tensor, Tensor]:
    """out (..., rows, heads, d) and lse (..., heads, rows) of attention without the sink -> with it:
    out scaled in place, a new lse (float32, in its layout)."""
    with_sink = torch.logaddexp(lse, sink.float().unsqueeze(-1))
    # A row with no key and a sink of -inf: both -inf; the clamp makes its scale 0, not NaN.
    scale = torch.exp(lse - with_sink.clamp(min=torch.finfo(torch.float32).min))
    # In place (out is the op's fresh output): one pass, products in float32, rounded once. Not while
    # torch.compile traces: inductor's backward then saw the op's out from before the rescale.
    if torch.compiler.is_compiling():
        return (out * _rows(scale).unsqueeze(-1)).to(out.dtype), with_sink
    return out.mul_(_rows(scale).unsqueeze(-1)), with_sink


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """The sink's gradient, of sink's dtype, from out and lse with the sink (add_sink's)."""
    # rowsum(dO * O) in float32 (products rounded to bf16 / fp16 cost the sink's gradient a few 1e-4),
    # from one float32 copy multiplied in place (a copy even when out is float32: out is saved).
    delta = out.to(torch.float32, copy=True).mul_(dout).sum(-1)  # (..., rows, heads)
    sink_probs = _rows(torch.exp(sink.float().unsqueeze(-1) - lse))
    return -(sink_probs * delta).reshape(-1, sink.shape[0]).sum(0).to(sink.dtype)
