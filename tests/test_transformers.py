"""attn_implementation="flashtile" in Hugging Face transformers (flashtile.integrations.transformers)
against the library's own sdpa / eager attention, on tiny random models (no downloads).

Logits, greedy generation, a padding-free (packed) training step against the padded batch, sliding
windows (Mistral), softcap + alternating sliding/full layers (Gemma2) and attention sinks + alternating
sliding/full layers (gpt-oss, against its eager attention: logits, gradients, generation). The comparisons run in
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

from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig  # noqa: E402

import flashtile  # noqa: E402
from flashtile.integrations import transformers as ft_hf  # noqa: E402
from flashtile.reference import attention_naive  # noqa: E402

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


def padded_and_packed(lengths) -> tuple:
    """Random sequences of these lengths as model inputs twice: a right-padded batch (input_ids,
    attention_mask, labels) and the same tokens packed padding-free (input_ids, position_ids
    restarting at 0, labels)."""
    seqs = [torch.randint(3, VOCAB, (n,), device=DEVICE) for n in lengths]
    padded_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=DEVICE)
    padded_mask = torch.zeros_like(padded_ids)
    for b, seq in enumerate(seqs):
        padded_ids[b, :len(seq)] = seq
        padded_mask[b, :len(seq)] = 1
    packed_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    padded = dict(input_ids=padded_ids, attention_mask=padded_mask,
                  labels=padded_ids.masked_fill(padded_mask == 0, -100))
    packed = dict(input_ids=packed_ids, position_ids=position_ids,
                  labels=packed_ids.masked_fill(position_ids == 0, -100))  # no target across a sequence boundary
    return padded, packed


def train_step(model, **inputs) -> tuple:
    """One training step's loss and parameter gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@fresh_thread
def test_packed_training_matches_padded(calls):
    """Padding-free batch (sequences end to end, position_ids restarting at 0) against the padded
    batch: same loss and gradients, for flashtile and for sdpa on the padded batch."""
    lengths = [7, 13, 4]
    ft, sdpa = build(tiny(), [NAME, "sdpa"])
    padded, packed = padded_and_packed(lengths)
    loss_padded, grads_padded = train_step(ft, **padded)
    n_padded = len(calls)
    loss_packed, grads_packed = train_step(ft, **packed)
    loss_sdpa, grads_sdpa = train_step(sdpa, **padded)

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
        by_positions = ft(packed["input_ids"], position_ids=packed["position_ids"]).logits
        by_kwargs = ft(packed["input_ids"], position_ids=packed["position_ids"], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
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


# --------------------------------------------------------------------------------------------
# Attention sinks: gpt-oss passes its per-head sink logits as s_aux, which goes to learnable_sink.


def gpt_oss_models(implementations, dtype=torch.float32):
    """Tiny gpt-oss (a sliding layer of window 6, then a full layer; 2 experts, 1 per token), all with
    the first model's weights, and sinks large enough to take a visible share of every row."""
    config = tiny(GptOssConfig, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                  num_local_experts=2, num_experts_per_tok=1, initializer_range=0.3,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    models = build(config, implementations, dtype)
    with torch.no_grad():
        for model in models:
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4) + i)
    return models


def sinks_of(model):
    return [layer.self_attn.sinks for layer in model.model.layers]


@pytest.mark.parametrize("dtype", LOGIT_DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@fresh_thread
def test_gpt_oss_sinks_logits_match_eager(dtype, padded, calls):
    ft, eager, truth = gpt_oss_models([NAME, "eager", "eager"])
    assert NAME in type(ft)._compatible_flash_implementations  # register() kept transformers from redirecting it
    ft.to(dtype)
    eager.to(dtype)
    ids, mask = batch_inputs(2, 17, pad=[0, 5] if padded else None)
    keep = mask.bool()
    with torch.no_grad():
        out = ft(ids, attention_mask=mask).logits
        ref = eager(ids, attention_mask=mask).logits
        exact = truth(ids, attention_mask=mask).logits
        assert_close(out[keep], ref[keep], exact[keep])
        # the sinks matter: without them (-inf), the logits differ
        for sink in sinks_of(truth):
            sink.fill_(float("-inf"))
        assert (truth(ids, attention_mask=mask).logits[keep] - exact[keep]).abs().max() > 1e-2
    assert [name for name, _ in calls] == ["flash_attn_varlen_func" if padded else "flash_attn_func"] * 2
    assert [kw["window_size"] for _, kw in calls] == [(5, 0), (-1, -1)]
    assert all(kw["learnable_sink"] is sink for (_, kw), sink in zip(calls, sinks_of(ft)))


@fresh_thread
def test_gpt_oss_sinks_training_matches_eager(calls):
    """Loss and gradients (the sinks' too) of a padded batch against eager's, then of the same
    sequences packed padding-free (position_ids restarting at 0) against eager's padded batch."""
    lengths = [9, 14, 5]
    ft, eager = gpt_oss_models([NAME, "eager"])
    padded, packed = padded_and_packed(lengths)
    loss_ref, grads_ref = train_step(eager, **padded)
    loss_padded, grads_padded = train_step(ft, **padded)
    loss_packed, grads_packed = train_step(ft, **packed)
    assert [name for name, _ in calls] == ["flash_attn_varlen_func"] * 4
    assert all(kw["learnable_sink"] is not None for _, kw in calls)
    sink_grads = [n for n in grads_ref if n.endswith("self_attn.sinks")]
    assert len(sink_grads) == 2 and all(grads_ref[n].abs().max() > 1e-4 for n in sink_grads)
    for what, loss, grads in (("padded", loss_padded, grads_padded), ("packed", loss_packed, grads_packed)):
        assert_close(loss, loss_ref, what=f"{what} loss vs eager")
        for name in grads_ref:
            assert_close(grads[name], grads_ref[name], what=f"{name}.grad {what} vs eager")


@pytest.mark.parametrize("cache, padded", [("dynamic", False), ("dynamic", True), ("static", True)])
@fresh_thread
def test_gpt_oss_sinks_generate_matches_eager(cache, padded, calls):
    """Greedy tokens with the cache, 10 steps past a prompt of 9: the sliding layer's window (6)
    moves on while decoding."""
    ft, eager = gpt_oss_models([NAME, "eager"])
    ids, mask = batch_inputs(2, 9, pad=[0, 3] if padded else None)
    options = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    if cache == "static":
        options.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        tokens = ft.generate(ids, attention_mask=mask, **options)
        ref_tokens = eager.generate(ids, attention_mask=mask, **options)
    assert tokens.shape == (2, 9 + 10)
    assert_same_greedy(eager, 9, tokens, ref_tokens, mask)
    assert len(calls) == 2 * 10 and all(kw["learnable_sink"] is not None for _, kw in calls)
    names = {name for name, _ in calls}
    assert "flash_attn_varlen_func" in names if padded else names == {"flash_attn_func"}


@fresh_thread
def test_attention_function_sinks():
    """s_aux straight into the attention function: float16 q, k, v with float32 sinks (the dtype some
    models keep them in), against the definition; the sinks' gradient comes back in float32. Then the
    errors: a position bias, a sink of the wrong shape."""
    module = torch.nn.Module()
    module.is_causal = True
    seqlen = 13
    q = torch.randn(2, 4, seqlen, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(2, 2, seqlen, 16, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(2))
    sinks = torch.tensor([-1.0, 0.5, 1.0, 3.0], device=DEVICE, requires_grad=True)
    out, _ = ft_hf.flashtile_attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=5, s_aux=sinks)
    grad = torch.randn_like(out)
    (sink_grad,) = torch.autograd.grad(out, sinks, grad)

    ref_sinks = sinks.detach().double().requires_grad_()
    ref, _ = attention_naive(*(t.detach().transpose(1, 2) for t in (q, k, v)), softmax_scale=0.25, causal=True,
                             window_size=(4, 0), learnable_sink=ref_sinks)
    (ref_grad,) = torch.autograd.grad(ref, ref_sinks, grad.double())
    assert sink_grad.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 2e-3
    assert (sink_grad.double() - ref_grad).abs().max() < 2e-3 * max(1.0, ref_grad.abs().max().item())

    with pytest.raises(NotImplementedError, match="position_bias"):
        ft_hf.flashtile_attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, seqlen, seqlen))
    with pytest.raises(ValueError, match="learnable_sink"):
        ft_hf.flashtile_attention_forward(module, q, k, v, None, s_aux=sinks[:2])
