"""attn_implementation="flashtile" in Hugging Face transformers (flashtile.integrations.transformers)
against the library's own sdpa / eager attention, on tiny random models (no downloads).

Logits, greedy generation, a padding-free (packed) training step against the padded batch, sliding
windows (Mistral) and softcap + alternating sliding/full layers (Gemma2). The comparisons run in
float32 (flashtile takes float32 inputs; on the GPU its products are true float32 too), plus bfloat16
logits on the GPU, judged against float32 with sdpa's own bfloat16 error as the yardstick.
Skipped when transformers is not installed.
"""

import copy
import functools
import threading
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "AttentionInterface"):
    pytest.skip("transformers without the AttentionInterface API", allow_module_level=True)

from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig  # noqa: E402

import flashtile  # noqa: E402
from flashtile.integrations import transformers as ft_hf  # noqa: E402

if ft_hf._release(transformers.__version__) < ft_hf.OLDEST_TESTED:
    pytest.skip(f"transformers {transformers.__version__} is older than the tested {ft_hf.TESTED_TRANSFORMERS} "
                "(register() warns there)", allow_module_level=True)

from _cases import DEVICE, ON_GPU  # noqa: E402

NAME = ft_hf.register()
VOCAB = 128
LOGIT_DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]


def tiny(config_cls=LlamaConfig, **overrides):
    """2 layers, hidden 64, 4 query heads and 2 key/value heads of dim 16, vocab 128."""
    fields = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(overrides)
    return config_cls(**fields)


def build(config, implementations, dtype=torch.float32):
    """One model per attention implementation, all with the first one's random weights."""
    models = []
    for impl in implementations:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if models:
            model.load_state_dict(models[0].state_dict())
        models.append(model.to(device=DEVICE, dtype=dtype).eval())
    assert models[0].config._attn_implementation == implementations[0]
    return models


def batch_inputs(batch, seqlen, pad=None, side="left"):
    """Token ids (batch, seqlen) and an attention mask with ``pad[b]`` padding tokens in row b."""
    ids = torch.randint(3, VOCAB, (batch, seqlen), device=DEVICE)
    mask = torch.ones(batch, seqlen, dtype=torch.long, device=DEVICE)
    for b, n in enumerate(pad or []):
        if n:
            if side == "left":
                mask[b, :n] = 0
            else:
                mask[b, seqlen - n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def assert_close(out, ref, truth=None, what="logits", fp32_tol=2e-5):
    """out (flashtile) against truth (float32 reference); ``ref`` (the other implementation in
    out's dtype) sets the yardstick: flashtile may err at most twice as much, plus a little."""
    truth = ref.float() if truth is None else truth.float()
    scale = max(1.0, truth.abs().max().item())
    err = (out.float() - truth).abs().max().item()
    ref_err = (ref.float() - truth).abs().max().item()
    tol = 2 * ref_err + (fp32_tol if out.dtype == torch.float32 else 1e-3) * scale
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (the reference's own error: {ref_err:.3g})"


def assert_same_greedy(model_ref, prompt_len, tokens, ref_tokens, mask=None):
    """Greedy tokens equal, or the first difference is a near-tie for the reference model."""
    if torch.equal(tokens, ref_tokens):
        return
    differ = (tokens != ref_tokens).any(dim=0).nonzero().flatten()
    step = int(differ[0])
    assert step >= prompt_len, "the prompts differ"
    prefix = ref_tokens[:, :step]
    prefix_mask = None if mask is None else torch.cat(
        [mask, mask.new_ones(mask.shape[0], step - mask.shape[1])], dim=1)
    with torch.no_grad():
        logits = model_ref(prefix, attention_mask=prefix_mask).logits[:, -1].float()
    rows = (tokens[:, step] != ref_tokens[:, step]).nonzero().flatten()
    for b in rows.tolist():
        gap = (logits[b, ref_tokens[b, step]] - logits[b, tokens[b, step]]).item()
        assert gap <= 1e-4 * max(1.0, logits[b].abs().max().item()), (
            f"row {b} differs at step {step - prompt_len} where the reference's choice leads by {gap:.3g}")


def fresh_thread(test):
    """On the CPU interpreter, run the test in a new thread with one torch thread.

    Two slowdowns of the interpreter under pytest, each about 3x on 2 cores: torch's thread pool
    and numpy's (which the interpreter runs on) spin against each other, and CPython 3.11 maps and
    unmaps a frame-stack chunk on every call of a hot loop that sits on a chunk boundary, which
    pytest's deep stack puts the interpreter on; a new thread starts from an empty stack."""
    if ON_GPU:
        return test

    @functools.wraps(test)
    def run(*args, **kwargs):
        failure = []

        def target():
            torch.set_num_threads(1)
            try:
                test(*args, **kwargs)
            except BaseException as e:  # re-raised in the test's own thread
                failure.append(e)

        threads = torch.get_num_threads()
        thread = threading.Thread(target=target, name=test.__name__)
        thread.start()
        thread.join()
        torch.set_num_threads(threads)
        if failure:
            raise failure[0]

    return run


@pytest.fixture
def calls(monkeypatch):
    """Records which flashtile entry point each attention call took, with its options."""
    record = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        real = getattr(flashtile, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            record.append((_name, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(flashtile, name, spy)
    return record


# --------------------------------------------------------------------------------------------


def test_mask_function():
    mask_fn = ft_hf.flashtile_attention_mask
    full = torch.ones(2, 7, dtype=torch.bool)
    assert mask_fn(2, 7, 7, attention_mask=full) is None
    assert mask_fn(2, 7, 7, attention_mask=None) is None
    padded = full.clone()
    padded[0, :3] = False
    assert torch.equal(mask_fn(2, 7, 7, attention_mask=padded), padded)
    # sliding-window cache: the last kv_length columns
    assert mask_fn(2, 1, 4, kv_offset=3, attention_mask=padded) is None  # its padding is out of the window
    padded[1, 5] = False
    assert torch.equal(mask_fn(2, 1, 4, kv_offset=3, attention_mask=padded), padded[:, -4:])
    # static cache of 10 slots holding 6 keys, no mask given: the first 6 slots
    assert torch.equal(mask_fn(2, 2, 10, q_offset=4, attention_mask=None), torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@fresh_thread
def test_logits_match_sdpa(dtype, padded, calls):
    ft, sdpa, truth = build(tiny(), [NAME, "sdpa", "sdpa"])
    ft.to(dtype)
    sdpa.to(dtype)
    ids, mask = batch_inputs(3, 29, pad=[0, 5, 11] if padded else None)
    with torch.inference_mode():
        out = ft(ids, attention_mask=mask).logits
        ref = sdpa(ids, attention_mask=mask).logits
        exact = truth(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert_close(out[keep], ref[keep], exact[keep])
    assert [name for name, _ in calls] == ["flash_attn_varlen_func" if padded else "flash_attn_func"] * 2
    assert all(kw["causal"] and kw["window_size"] == (-1, -1) and kw["dropout_p"] == 0.0 for _, kw in calls)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@fresh_thread
def test_generate_matches_sdpa(padded):
    ft, sdpa = build(tiny(), [NAME, "sdpa"])
    ids, mask = batch_inputs(2, 9, pad=[0, 4] if padded else None)
    options = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = ft.generate(ids, attention_mask=mask, **options)
        ref_tokens = sdpa.generate(ids, attention_mask=mask, **options)
    assert tokens.shape == (2, 9 + 32)
    assert_same_greedy(sdpa, 9, tokens, ref_tokens, mask)


@fresh_thread
def test_generate_static_cache_matches_sdpa(calls):
    """A StaticCache hands over its whole buffer: the mask says which slots hold keys."""
    ft, sdpa = build(tiny(), [NAME, "sdpa"])
    ids, mask = batch_inputs(2, 7, pad=[3, 0])
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                   cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        tokens = ft.generate(ids, attention_mask=mask, **options)
        ref_tokens = sdpa.generate(ids, attention_mask=mask, **options)
    assert_same_greedy(sdpa, 7, tokens, ref_tokens, mask)
    assert {name for name, _ in calls} == {"flash_attn_varlen_func"}


@fresh_thread
def test_packed_training_matches_padded(calls):
    """Padding-free batch (sequences end to end, position_ids restarting at 0) against the padded
    batch: same loss and gradients, for flashtile and for sdpa on the padded batch."""
    lengths = [7, 13, 4]
    ft, sdpa = build(tiny(), [NAME, "sdpa"])
    seqs = [torch.randint(3, VOCAB, (n,), device=DEVICE) for n in lengths]

    width = max(lengths)
    padded_ids = torch.zeros(len(lengths), width, dtype=torch.long, device=DEVICE)
    padded_mask = torch.zeros_like(padded_ids)
    for b, s in enumerate(seqs):
        padded_ids[b, :len(s)] = s
        padded_mask[b, :len(s)] = 1
    padded_labels = padded_ids.masked_fill(padded_mask == 0, -100)

    packed_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    packed_labels = packed_ids.clone()
    packed_labels[position_ids == 0] = -100  # no target across a sequence boundary

    def step(model, **inputs):
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    loss_padded, grads_padded = step(ft, input_ids=padded_ids, attention_mask=padded_mask, labels=padded_labels)
    n_padded = len(calls)
    loss_packed, grads_packed = step(ft, input_ids=packed_ids, position_ids=position_ids, labels=packed_labels)
    loss_sdpa, grads_sdpa = step(sdpa, input_ids=padded_ids, attention_mask=padded_mask, labels=padded_labels)

    assert [name for name, _ in calls] == ["flash_attn_varlen_func"] * (2 * n_padded)
    assert_close(loss_packed, loss_padded, what="loss packed vs padded")
    assert_close(loss_padded, loss_sdpa, what="loss vs sdpa")
    for name in grads_sdpa:
        assert_close(grads_packed[name], grads_padded[name], what=f"{name}.grad packed vs padded")
        assert_close(grads_padded[name], grads_sdpa[name], what=f"{name}.grad vs sdpa")

    # The same packed batch described by DataCollatorWithFlattening's flash-attention kwargs.
    cu = torch.tensor([0, 7, 20, 24], dtype=torch.int32, device=DEVICE)
    ft.eval()
    with torch.no_grad():
        by_positions = ft(packed_ids, position_ids=position_ids).logits
        by_kwargs = ft(packed_ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=13, max_length_k=13).logits
    assert_close(by_kwargs, by_positions, what="logits with cu_seq_lens kwargs")


@fresh_thread
def test_register_under_another_name(calls):
    assert ft_hf.register("tiled") == "tiled"
    ft, other = build(tiny(), [NAME, "tiled"])
    ids, _ = batch_inputs(2, 6)
    with torch.no_grad():
        assert torch.equal(ft(ids).logits, other(ids).logits)
    assert len(calls) == 4


@fresh_thread
def test_dropout_reaches_flashtile(calls):
    ft, = build(tiny(attention_dropout=0.25), [NAME])
    ids, _ = batch_inputs(1, 8)
    ft.train()
    ft(ids)
    ft.eval()
    with torch.no_grad():
        ft(ids)
    assert [kw["dropout_p"] for _, kw in calls] == [0.25, 0.25, 0.0, 0.0]


@fresh_thread
def test_sliding_window_matches_sdpa(calls):
    """Mistral with an 8-token window: prefill of 21 tokens (padded) and 10 greedy steps past the
    window with the sliding-window cache."""
    window = 8
    ft, sdpa = build(tiny(MistralConfig, sliding_window=window), [NAME, "sdpa"])
    ids, mask = batch_inputs(2, 21, pad=[0, 6])
    with torch.no_grad():
        out = ft(ids, attention_mask=mask).logits
        ref = sdpa(ids, attention_mask=mask).logits
        keep = mask.bool()
        assert_close(out[keep], ref[keep])
        assert all(kw["window_size"] == (window - 1, 0) for _, kw in calls)
        # the window matters here: without it, the logits differ
        wide, = build(tiny(MistralConfig, sliding_window=None), ["sdpa"])
        wide.load_state_dict(sdpa.state_dict())
        assert (wide(ids, attention_mask=mask).logits[keep] - ref[keep]).abs().max() > 1e-3

        prompt_ids, prompt_mask = batch_inputs(2, 6, pad=[0, 2])
        options = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
        tokens = ft.generate(prompt_ids, attention_mask=prompt_mask, **options)
        ref_tokens = sdpa.generate(prompt_ids, attention_mask=prompt_mask, **options)
    assert_same_greedy(sdpa, 6, tokens, ref_tokens, prompt_mask)


@fresh_thread
def test_softcap_and_sliding_gemma2_matches_eager(calls):
    """Gemma2: attention logit softcap, query_pre_attn_scalar scaling, a sliding layer then a
    full layer (sdpa refuses softcap: the reference is eager)."""
    fields = dict(sliding_window=6, attn_logit_softcapping=1.0, query_pre_attn_scalar=8, final_logit_softcapping=None,
                  initializer_range=0.3, layer_types=["sliding_attention", "full_attention"])
    ft, eager = build(tiny(Gemma2Config, **fields), [NAME, "eager"])
    ids, mask = batch_inputs(2, 17, pad=[0, 5], side="right")
    with torch.no_grad():
        out = ft(ids, attention_mask=mask).logits
        ref = eager(ids, attention_mask=mask).logits
        keep = mask.bool()
        assert_close(out[keep], ref[keep])
        # softcap and window matter: without them the logits differ
        for change in (dict(attn_logit_softcapping=None), dict(sliding_window=64)):
            other, = build(tiny(Gemma2Config, **{**fields, **change}), ["eager"])
            other.load_state_dict(eager.state_dict())
            assert (other(ids, attention_mask=mask).logits[keep] - ref[keep]).abs().max() > 1e-3, change
    windows = [kw["window_size"] for _, kw in calls]
    assert windows == [(5, 0), (-1, -1)]
    assert all(kw["softcap"] == 1.0 and kw["softmax_scale"] == 8 ** -0.5 for _, kw in calls)


@fresh_thread
def test_attention_function_bidirectional_window():
    """Encoder layers (is_causal False) with a window: transformers' bidirectional sliding mask keeps
    |i - j| <= w, and such models (ModernBERT) pass sliding_window = w + 1 to the attention function."""
    module = torch.nn.Module()
    module.is_causal = False
    half, seqlen = 3, 11
    q = torch.randn(2, 4, seqlen, 16, device=DEVICE)
    k, v = (torch.randn(2, 2, seqlen, 16, device=DEVICE) for _ in range(2))
    out, weights = ft_hf.flashtile_attention_forward(module, q, k, v, None, sliding_window=half + 1, scaling=0.3)
    assert weights is None and out.shape == (2, seqlen, 4, 16)
    pos = torch.arange(seqlen, device=DEVICE)
    allowed = (pos[:, None] - pos[None, :]).abs() <= half
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=allowed, scale=0.3)
    assert_close(out, ref.transpose(1, 2))

    with pytest.raises(NotImplementedError, match="2D padding mask"):
        ft_hf.flashtile_attention_forward(module, q, k, v, allowed[None, None].expand(2, 1, -1, -1))


def test_register_warns_on_an_untested_older_transformers():
    with pytest.warns(RuntimeWarning, match="tested with transformers 5.23 to 5.24; this is 5.17.0"):
        ft_hf.warn_if_untested("5.17.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft_hf.warn_if_untested("5.24.1")
