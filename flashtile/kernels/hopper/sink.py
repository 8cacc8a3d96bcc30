"""Learnable sinks in the Hopper forward's epilogue: the sink logit joins the row's softmax as one more
key with no value (the portable kernels' kernels/portable/sink.py has the whole derivation)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .scores import LOG2E


@gluon.jit
def load_sink_log2(sink_ptr, head):
    """Head ``head``'s sink logit in log2 units."""
    return gl.load(sink_ptr + head).to(gl.float32) * LOG2E


@gluon.jit
def fold_sink(m_i, l_i, sink_log2):
    """Rows' running (max, sum) in log2 units with a sink logit (log2 units) taken in -> (alpha, m, l):
    the rescale of the rows' accumulators, the new max and sum. A sink of -inf on a row without keys
    leaves m = -inf and l = 0."""
    m_new = gl.maximum(m_i, sink_log2)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    return alpha, m_new, l_i * alpha + gl.exp2(sink_log2 - m_safe)
