"""Learnable sinks (gpt-oss), folded into the kernels: a sink logit s_h per query head joins every
row's softmax as one more key with no value.

Forward: after the key loop, the row's running (max m, sum l) take the sink like a key block of one
column (fold_sink); out = acc * alpha / l and lse = m + log2(l) then include it. A row that saw no key
gets out 0 and lse = s_h. Split-KV folds it once, in the combine kernel, not in every split.
Backward: the kernels' P = exp(S - lse) with that lse is exact for the keys, and delta = rowsum(dO * O)
is unchanged (the sink adds nothing to O); the sink's own gradient is -sum_i exp(s_h - lse_i) delta_i
over the rows of head h, summed by the preprocess per program (sink_grad_part) and over programs on
the host, in a fixed order."""

import triton
import triton.language as tl

from .scores import LOG2E


@triton.jit
def load_sink_log2(Sink, heads):
    """The sink logits of ``heads`` (a scalar or a vector of query heads) in log2 units."""
    return tl.load(Sink + heads).to(tl.float32) * LOG2E


@triton.jit
def fold_sink(m_i, l_i, sink_log2):
    """(m_i, l_i) of rows in log2 units with the sink taken in -> (alpha, m, l): acc's rescale, the new
    max and sum. A sink of -inf on a row without keys leaves m = -inf and l = 0 (no NaN)."""
    m_new = tl.maximum(m_i, sink_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    return alpha, m_new, l_i * alpha + tl.exp2(sink_log2 - m_safe)


@triton.jit
def sink_grad_part(Sink, h, lse, delta, in_rows):
    """This block's share of d sink[h]: -sum over its rows of exp(sink - lse) * delta (lse natural-log,
    with the sink). Rows outside (in_rows false) and rows with lse = -inf (a sink of -inf) add 0."""
    sink = tl.load(Sink + h).to(tl.float32)
    keep = in_rows & (lse != float("-inf"))
    probs = tl.exp2((sink - tl.where(keep, lse, 0.0)) * LOG2E)
    return -tl.sum(tl.where(keep, probs * delta, 0.0), 0)
