"""Accuracy checks shared by the tests, the demo and debug tools.

FlashAttention's rule: a kernel's error against a float64 reference may be at most about
twice the error that plain PyTorch makes computing the same thing in the input dtype,
plus a small epsilon. Errors are relative Frobenius norms, ``||x - ref|| / ||ref||``.
"""

from typing import List, Tuple

import torch

from .reference import attention_naive

# The call options the references take (the rest, e.g. deterministic, do not change the result).
REFERENCE_OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "dropout_p",
                     "learnable_sink", "attn_bias")

# Floor on the allowed error per dtype, for cases where PyTorch's own error is tiny.
EPSILON = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere gives inf.

    Where ref is exactly zero (a gradient that vanishes, e.g. a window of one key) the
    relative error is undefined; the RMS of the difference is returned instead."""
    x64, ref64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    denom = ref64.norm().item()
    diff = (x64 - ref64).norm().item()
    if denom == 0.0:
        return diff / max(ref64.numel(), 1) ** 0.5
    return diff / denom


def allowed_error(torch_error: float, dtype: torch.dtype, factor: float = 2.0) -> float:
    return factor * torch_error + EPSILON[dtype]


def reference_errors(q, k, v, out, dout=None, grads=None, dropout_mask=None, reference=attention_naive,
                     **options) -> Tuple[List[Tuple[str, float, float]], torch.Tensor]:
    """Compare a kernel's ``out`` (and, given ``dout`` and ``grads``, its dq, dk, dv) with
    the float64 reference.

    Returns ``([(name, our_error, pytorch_error), ...], reference_lse)``, where pytorch_error
    is the error of the same computation done by PyTorch in the input dtype. ``options`` are
    the attention options (softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p);
    ``dropout_mask`` is the kernel's own mask, applied to both references. ``reference``:
    attention_naive, or attention_varlen_naive with the batch layout bound (functools.partial).
    """
    backward = grads is not None
    # Separate leaves, so the float64 reference's gradients are not rounded to the input dtype. A
    # learnable sink and an attn_bias are more leaves, in that order; ``grads`` holds the gradients
    # of those of them that require grad, after dq, dk, dv.
    names, inputs = ["dq", "dk", "dv"], [q, k, v]
    extras = [name for name in ("learnable_sink", "attn_bias") if options.get(name) is not None]
    for name in extras:
        inputs.append(options.pop(name))
        names.append({"learnable_sink": "dsink", "attn_bias": "dbias"}[name])
    leaves64 = [t.detach().double().requires_grad_(backward) for t in inputs]
    leaves = [t.detach().clone().requires_grad_(backward) for t in inputs]
    options64 = {**options, **dict(zip(extras, leaves64[3:]))}
    options = {**options, **dict(zip(extras, leaves[3:]))}
    ref_out, ref_lse = reference(*leaves64[:3], dropout_mask=dropout_mask, dtype=torch.float64, **options64)
    same_out, _ = reference(*leaves[:3], dropout_mask=dropout_mask, dtype=None, **options)
    errors = [("out", rel_error(out, ref_out), rel_error(same_out, ref_out))]
    if backward:
        graded = [i for i, t in enumerate(inputs) if i < 3 or t.requires_grad][:len(grads)]
        ref_grads = torch.autograd.grad(ref_out, [leaves64[i] for i in graded], dout.double())
        same_grads = torch.autograd.grad(same_out, [leaves[i] for i in graded], dout)
        for i, g, rg, sg in zip(graded, grads, ref_grads, same_grads):
            errors.append((names[i], rel_error(g, rg), rel_error(sg, rg)))
    return errors, ref_lse


def call_errors(fn, q, k, v, *, backward: bool = True, reference=attention_naive, **options):
    """Run ``fn(q, k, v, return_attn_probs=True, **options)`` and measure its out (and, with
    ``backward``, dq, dk, dv through autograd with a random dout) against the float64 reference.

    With dropout the reference applies the kernel's own mask, read off the sign of the returned
    probabilities (dropped entries are negated). Returns ``(errors, lse, reference_lse)``, errors as
    :func:`reference_errors` gives them; raises AssertionError on a wrong output shape or dtype."""
    out, lse, probs = fn(q, k, v, return_attn_probs=True, **options)
    expected = (*q.shape[:-1], v.shape[-1])  # the output takes v's head dim
    if tuple(out.shape) != expected or out.dtype != q.dtype:
        raise AssertionError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected "
                             f"{expected}, {q.dtype}")
    dropout_mask = probs >= 0 if options.get("dropout_p", 0.0) > 0 else None
    dout = grads = None
    if backward:
        dout = torch.randn_like(out)
        extras = [(name, options.get(key)) for name, key in (("dsink", "learnable_sink"), ("dbias", "attn_bias"))]
        extras = [(name, t) for name, t in extras if t is not None and t.requires_grad]
        inputs = (q, k, v, *(t for _, t in extras))
        grads = torch.autograd.grad(out, inputs, dout)
        for name, g, t in zip(("dq", "dk", "dv", *(name for name, _ in extras)), grads, inputs):
            if g.shape != t.shape or g.dtype != t.dtype:
                raise AssertionError(f"{name} has shape {tuple(g.shape)} and dtype {g.dtype}; expected "
                                     f"{tuple(t.shape)}, {t.dtype}")
    ref_options = {name: options[name] for name in REFERENCE_OPTIONS if name in options}
    errors, ref_lse = reference_errors(q, k, v, out, dout, grads, dropout_mask=dropout_mask, reference=reference,
                                       **ref_options)
    return errors, lse, ref_lse


def check_errors(errors: List[Tuple[str, float, float]], dtype: torch.dtype, factor: float = 2.0) -> None:
    """Assert each (name, our_error, pytorch_error) from :func:`reference_errors` obeys the rule."""
    for name, err, base in errors:
        bound = allowed_error(base, dtype, factor)
        assert err <= bound, (f"{name}: relative error {err:.3e} exceeds {factor}x PyTorch's {dtype} error "
                              f"{base:.3e} + {EPSILON[dtype]:.0e} = {bound:.3e}")


def check_lse(lse: torch.Tensor, ref_lse: torch.Tensor, atol: float = 1e-3) -> None:
    """lse is fp32 whatever the input dtype: -inf exactly where the reference's is, close elsewhere."""
    ref_lse = ref_lse.to(lse.device)
    assert lse.dtype == torch.float32, f"softmax_lse has dtype {lse.dtype}, expected float32"
    assert lse.shape == ref_lse.shape, f"softmax_lse has shape {tuple(lse.shape)}, expected {tuple(ref_lse.shape)}"
    ref_empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ref_empty), "softmax_lse is -inf on a different set of rows"
    finite = ~ref_empty
    if finite.any():
        worst = (lse[finite].double() - ref_lse[finite].double()).abs().max().item()
        scale = 1.0 + ref_lse[finite].double().abs().max().item()
        assert worst <= atol * scale, f"softmax_lse differs by {worst:.3e} (allowed {atol * scale:.3e})"
