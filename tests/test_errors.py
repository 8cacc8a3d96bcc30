"""Bad input raises a clear exception that names the argument, before any kernel runs."""

import pytest
import torch

from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       unpad_input)

from _cases import DEVICE, ON_GPU, make_qkv, randn


def _qkv(**shape):
    dims = dict(b=2, sq=16, sk=16, h=4, hk=2, d=32)
    dims.update(shape)
    return make_qkv(dims["b"], dims["sq"], dims["sk"], dims["h"], dims["hk"], dims["d"], torch.float16,
                    requires_grad=False)


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_not_a_tensor():
    q, k, v = _qkv()
    _raises(TypeError, "k must be a torch.Tensor", flash_attn_func, q, k.tolist(), v)


def test_bad_dtypes():
    q, k, v = _qkv()
    _raises(TypeError, "q has dtype int32; expected float16, bfloat16 or float32", flash_attn_func, q.int(), k, v)
    _raises(TypeError, "v has dtype float32 but q has float16", flash_attn_func, q, k, v.float())


def test_bad_ranks_and_shapes():
    q, k, v = _qkv()
    _raises(ValueError, "q must have 4 dimensions", flash_attn_func, q[0], k, v)
    _raises(ValueError, "v has shape .* expected the shape of k", flash_attn_func, q, k, v[:, :8])
    _raises(ValueError, "k has batch size 1 but q has 2", flash_attn_func, q, k[:1], v[:1])
    _raises(ValueError, "k has head dim 16 but q has 32", flash_attn_func, q, k[..., :16], v[..., :16])


def test_head_dim_too_large():
    q, k, v = _qkv(d=264)
    _raises(ValueError, "head dim 264 .* 1 <= head_dim <= 256", flash_attn_func, q, k, v)


def test_heads_not_a_multiple():
    q, k, v = _qkv(h=5, hk=2)
    _raises(ValueError, "q has 5 heads and k has 2", flash_attn_func, q, k, v)


def test_non_unit_last_stride():
    q, k, v = _qkv()
    strided = randn(2, 16, 4, 64, dtype=torch.float16)[..., ::2]
    _raises(ValueError, "q must have a unit stride in its last", flash_attn_func, strided, k, v)


def test_device_mismatch():
    q, k, v = _qkv()
    other = torch.empty_like(k, device="meta") if not ON_GPU else k.cpu()
    _raises(ValueError, "k is on .* but q is on", flash_attn_func, q, other, v)


def test_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (torch.randn(1, 4, 1, 16, dtype=torch.float16) for _ in range(3))
    _raises(ValueError, "q is on the CPU", flash_attn_func, q, k, v)


@pytest.mark.skipif(ON_GPU, reason="the CPU interpreter's limit")
def test_bfloat16_on_the_interpreter():
    q, k, v = (torch.randn(1, 4, 1, 16, dtype=torch.bfloat16) for _ in range(3))
    _raises(ValueError, "q is bfloat16 on the CPU: Triton's interpreter", flash_attn_func, q, k, v)


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5, "0.1"])
def test_bad_dropout(dropout_p):
    _raises(ValueError, "dropout_p must be a number in \\[0, 1\\)", flash_attn_func, *_qkv(), dropout_p=dropout_p)


@pytest.mark.parametrize("window_size", [(-2, 0), (1, 2, 3), (1.5, 2), "full", None])
def test_bad_window(window_size):
    _raises(ValueError, "window_size", flash_attn_func, *_qkv(), window_size=window_size)


def test_bad_softcap_and_scale():
    _raises(ValueError, "softcap must be a number >= 0", flash_attn_func, *_qkv(), softcap=-1.0)
    _raises(TypeError, "softmax_scale must be a float or None", flash_attn_func, *_qkv(), softmax_scale="1")


def test_bad_alibi_slopes():
    q, k, v = _qkv()
    _raises(TypeError, "alibi_slopes has dtype float16; expected float32", flash_attn_func, q, k, v,
            alibi_slopes=torch.ones(4, device=DEVICE, dtype=torch.float16))
    _raises(ValueError, "alibi_slopes has shape \\(3,\\); expected \\(4,\\)", flash_attn_func, q, k, v,
            alibi_slopes=torch.ones(3, device=DEVICE))
    _raises(ValueError, "alibi_slopes has shape \\(3, 4\\)", flash_attn_func, q, k, v,
            alibi_slopes=torch.ones(3, 4, device=DEVICE))
    other = "meta" if not ON_GPU else "cpu"
    _raises(ValueError, "alibi_slopes is on", flash_attn_func, q, k, v, alibi_slopes=torch.ones(4, device=other))


def test_bad_packed_shapes():
    qkv = randn(2, 16, 2, 4, 32, dtype=torch.float16)
    _raises(ValueError, "qkv must have shape \\(batch, seqlen, 3, nheads, headdim\\)", flash_attn_qkvpacked_func, qkv)
    _raises(ValueError, "qkv must have 5 dimensions", flash_attn_qkvpacked_func, qkv[0])
    q = randn(2, 16, 4, 32, dtype=torch.float16)
    kv = randn(2, 16, 3, 2, 32, dtype=torch.float16)
    _raises(ValueError, "kv must have shape \\(batch, seqlen_k, 2, nheads_k, headdim\\)",
            flash_attn_kvpacked_func, q, kv)


def test_still_works_after_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError):
        flash_attn_func(q, k, v, dropout_p=2.0)
    out = flash_attn_func(q, k, v)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# Varlen: the layout arguments
# ---------------------------------------------------------------------------------------------

def _packed(lengths=(5, 0, 11), h=4, hk=2, d=32):
    total = sum(lengths)
    q = randn(total, h, d, dtype=torch.float16)
    k = randn(total, hk, d, dtype=torch.float16)
    v = randn(total, hk, d, dtype=torch.float16)
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
    return q, k, v, cu, max(lengths)


def test_varlen_bad_cu_seqlens():
    q, k, v, cu, n = _packed()
    _raises(TypeError, "cu_seqlens_q has dtype int64; expected int32", flash_attn_varlen_func, q, k, v,
            cu.long(), cu, n, n)
    _raises(ValueError, "cu_seqlens_k has shape \\(3,\\); expected \\(4,\\)", flash_attn_varlen_func, q, k, v,
            cu, cu[:3], n, n)
    _raises(ValueError, "cu_seqlens_q must be a 1-D int32 tensor", flash_attn_varlen_func, q, k, v,
            cu[None], cu, n, n)
    _raises(TypeError, "max_seqlen_k must be a Python int", flash_attn_varlen_func, q, k, v, cu, cu, n, float(n))
    _raises(TypeError, "seqused_k has dtype float32", flash_attn_varlen_func, q, k, v, cu, cu, n, n,
            seqused_k=torch.ones(3, device=DEVICE))
    _raises(ValueError, "seqused_q has shape \\(2,\\); expected \\(3,\\)", flash_attn_varlen_func, q, k, v,
            cu, cu, n, n, seqused_q=torch.ones(2, dtype=torch.int32, device=DEVICE))
    _raises(ValueError, "seqused_k must be contiguous", flash_attn_varlen_func, q, k, v, cu, cu, n, n,
            seqused_k=torch.ones(3, 2, dtype=torch.int32, device=DEVICE)[:, 0])
    other = "meta" if not ON_GPU else "cpu"
    _raises(ValueError, "cu_seqlens_q is on", flash_attn_varlen_func, q, k, v, cu.to(other), cu, n, n)


def test_varlen_bad_shapes():
    q, k, v, cu, n = _packed()
    _raises(ValueError, "q must have 3 dimensions", flash_attn_varlen_func, q[None], k, v, cu, cu, n, n)
    k3, v3 = (t[:, :1].expand(-1, 3, -1) for t in (k, v))
    _raises(ValueError, "q has 4 heads and k has 3", flash_attn_varlen_func, q, k3, v3, cu, cu, n, n)
    _raises(ValueError, "v has shape \\(16, 1, 32\\); expected the shape of k, \\(16, 2, 32\\), in every dim but",
            flash_attn_varlen_func, q, k, v[:, :1], cu, cu, n, n)
    _raises(ValueError, "k must have 4 dimensions", flash_attn_varlen_func, q, k, v, cu, cu, n, n,
            block_table=torch.zeros(3, 1, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(ON_GPU, reason="contents are validated on CPU (free) or with FLASHTILE_VALIDATE=1")
def test_varlen_contents_checked_on_cpu():
    q, k, v, cu, n = _packed()
    _raises(ValueError, "cu_seqlens_q must not decrease: entry 2 \\(3\\) < entry 1 \\(5\\)",
            flash_attn_varlen_func, q, k, v, torch.tensor([0, 5, 3, 16], dtype=torch.int32), cu, n, n)
    _raises(ValueError, "cu_seqlens_k ends at 15 but k/v holds 16", flash_attn_varlen_func, q, k, v,
            cu, cu - torch.tensor([0, 0, 0, 1], dtype=torch.int32), n, n)
    _raises(ValueError, "max_seqlen_q is 10 but a sequence in cu_seqlens_q has 11", flash_attn_varlen_func,
            q, k, v, cu, cu, 10, n)
    _raises(ValueError, "seqused_k\\[2\\] = 12 is outside \\[0, 11\\]", flash_attn_varlen_func, q, k, v, cu, cu,
            n, n, seqused_k=torch.tensor([1, 0, 12], dtype=torch.int32))


def test_varlen_contents_checked_when_validating(monkeypatch):
    monkeypatch.setenv("FLASHTILE_VALIDATE", "1")
    q, k, v, cu, n = _packed()
    _raises(ValueError, "cu_seqlens_q must start at 0", flash_attn_varlen_func, q, k, v, cu + 1, cu, n, n)


def test_unpad_input_bad_mask():
    hidden = randn(2, 6, 3, dtype=torch.float32)
    _raises(ValueError, "attention_mask has shape \\(2, 5\\)", unpad_input, hidden,
            torch.ones(2, 5, dtype=torch.bool, device=DEVICE))


@pytest.mark.skipif(ON_GPU, reason="contents are validated on CPU (free) or with FLASHTILE_VALIDATE=1")
def test_block_table_contents_checked_on_cpu():
    q, _, _, cu, n = _packed()
    pages = randn(4, 16, 2, 32, dtype=torch.float16)
    table = torch.tensor([[0], [1], [7]], dtype=torch.int32)
    with torch.no_grad():
        _raises(ValueError, "block_table\\[2\\] points at page 7, outside the 4 pages", flash_attn_varlen_func,
                q, pages, pages, cu, cu, n, n, block_table=table)
        _raises(ValueError, "sequence 2 has 11 keys but block_table holds 1 pages of 8 rows",
                flash_attn_varlen_func, q, pages[:, :8], pages[:, :8], cu, cu, n, n, block_table=table % 4)
        _raises(TypeError, "block_table has dtype int64", flash_attn_varlen_func, q, pages, pages, cu, cu, n, n,
                block_table=table.long())
