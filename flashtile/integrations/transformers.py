"""flashtile as an attention implementation of Hugging Face transformers.

    import flashtile.integrations.transformers as ft_hf
    ft_hf.register()                      # once per process, before building the model
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flashtile")
    # or: AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashtile")
    # or, on a built model: model.set_attn_implementation("flashtile")

Works with models that call attention through transformers' ``AttentionInterface`` (Llama, Mistral,
Qwen2/3, Gemma2/3, gpt-oss, ...), in training and in ``generate`` with a DynamicCache (or a StaticCache).
Tested against transformers 5.23 and 5.24 (the range of flashtile's ``hf`` extra); gpt-oss against 5.24.

What the attention function receives, and what it calls (q, k, v are the model's (batch, heads, seq,
dim) tensors, handed to flashtile as (batch, seq, heads, dim) views without copies; GQA/MQA key and
value heads are used as they are, never repeated):

* no ``attention_mask`` (the mask function below returns None when nothing is padded):
  ``flash_attn_func``, causal aligned to the bottom-right corner, so a decoding step (q_len < k_len)
  sees its whole prefix;
* a 2D padding mask (batch, keys): the mask's last k_len columns mark the keys in use, its last
  q_len columns the queries; both are packed with indices from ``unpad_input``, attended with
  ``flash_attn_varlen_func`` (each sequence causal on its own tokens) and scattered back with
  ``pad_input``. Padding may sit anywhere (left or right): token t of a sequence still sees exactly
  the real tokens at or before it;
* a padding-free (packed) batch: no mask and ``position_ids`` that start again inside a row (a
  token whose position is not the previous one's + 1 starts a new sequence, the rule transformers'
  own mask code uses), or the ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments of
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: ``flash_attn_varlen_func`` on
  the rows end to end, one sequence per run of positions.

Options: ``scaling`` -> softmax_scale, ``softcap`` -> softcap, ``dropout`` (the models pass 0 in
eval mode) -> dropout_p, ``sliding_window`` -> window_size. Window convention: transformers'
causal sliding-window mask keeps key j for query i when ``i - sliding_window < j <= i``, i.e.
``sliding_window`` keys including the query's own, so the window is
``(sliding_window - 1, 0)``; for bidirectional layers the attention function gets a
``sliding_window`` whose symmetric flash window is ``(sliding_window - 1, sliding_window - 1)``
(ModernBERT passes its config's half-window + 1 for that reason), which is used as is.

Attention sinks: gpt-oss passes its (heads,) parameter of per-head sink logits as ``s_aux``; it goes
to flashtile as ``learnable_sink`` on every route above (dense, padded, packed, and ``generate``'s
prefill and decoding steps with either cache), in the dtype the model holds it, and its gradient
reaches that parameter.
gpt-oss lists the flash kernels it accepts (``_compatible_flash_implementations``), and transformers
sends any other implementation whose name contains "flash" to the first of them: ``register`` adds
its name to that list for the models in ``SINK_MODELS`` (gpt-oss). Other models with such a list are
left alone (a "flash..." name is redirected there; under a name without "flash", such as
``register("tiled")``, their ``s_aux`` reaches flashtile too, untested).

Not supported (a clear error): arbitrary 4D masks, additive position biases (``position_bias``),
transformers' continuous-batching paged cache. ``output_attentions`` returns no weights.
"""

import os
import warnings
import weakref
from typing import Dict, Optional, Tuple

import torch

import flashtile

__all__ = ["register", "flashtile_attention_forward", "flashtile_attention_mask"]

DEFAULT_NAME = "flashtile"

# transformers releases whose integration points this module has been checked against.
TESTED_TRANSFORMERS = "5.23 to 5.24"
OLDEST_TESTED = (5, 23)


# --------------------------------------------------------------------------------------------
# Per-forward memo: every layer of one forward gets the same mask / position_ids tensor, and the
# indices, cu_seqlens and max_seqlen derived from it cost host syncs; compute them once per tensor.


class _Memo:
    """A few results keyed on a tensor object (held weakly) and its in-place version counter."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: Dict[Tuple[int, tuple], tuple] = {}

    def get(self, tensor: torch.Tensor, key: tuple, compute):
        if torch.compiler.is_compiling() or tensor.is_inference():
            return compute()  # inference-mode tensors have no version counter to tell edits apart
        slot = (id(tensor), key)
        hit = self.entries.get(slot)
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        value = compute()
        self.entries = {k: e for k, e in self.entries.items() if e[0]() is not None}
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[slot] = (weakref.ref(tensor), tensor._version, value)
        return value


_mask_memo = _Memo()
_position_memo = _Memo()


def _unpad_indices(mask: torch.Tensor):
    """(indices, cu_seqlens, max_seqlen) of the tokens a (batch, seqlen) mask marks, from
    flashtile's unpad_input on an empty feature dim (it packs nothing, only counts)."""
    empty = mask.new_empty(mask.shape + (0,), dtype=torch.float16)
    _, indices, cu_seqlens, max_seqlen, _ = flashtile.unpad_input(empty, mask)
    return indices, cu_seqlens, max_seqlen


def _gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, heads, dim) -> (len(indices), heads, dim), rows of the flattened batch."""
    return flashtile.index_first_axis(x.reshape((x.shape[0] * x.shape[1],) + tuple(x.shape[2:])), indices)


def _packed_bounds(position_ids: torch.Tensor, batch: int, seqlen: int):
    """cu_seqlens (int32) and max_seqlen of the sequences packed in the rows, or None when each
    row holds a single sequence. A new sequence starts at each row's first token and wherever a
    position is not the previous position + 1."""
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[-1] != seqlen or pos.shape[0] not in (1, batch):
        return None

    def compute():
        p = pos.expand(batch, seqlen)
        starts = torch.ones((batch, seqlen), dtype=torch.bool, device=p.device)
        starts[:, 1:] = (p[:, 1:] - p[:, :-1]) != 1
        first = torch.nonzero(starts.flatten()).flatten()  # one host sync
        if first.numel() == batch:
            return None
        total = torch.full((1,), batch * seqlen, dtype=torch.int32, device=p.device)
        cu_seqlens = torch.cat([first.to(torch.int32), total])
        max_seqlen = int(cu_seqlens.diff().max().item())
        return cu_seqlens, max_seqlen

    return _position_memo.get(position_ids, ("packed", batch, seqlen), compute)


# --------------------------------------------------------------------------------------------
# The mask function transformers calls (through AttentionMaskInterface) to build the mask that
# the attention function then receives.


def flashtile_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                             mask_function=None, attention_mask: Optional[torch.Tensor] = None,
                             device=None, **kwargs) -> Optional[torch.Tensor]:
    """The 2D (batch, keys) boolean mask of the keys in use, or None when every key is in use.

    Causality, sliding windows and packed sequences are not materialized: the attention function
    applies them (``mask_function`` is not read, as for transformers' flash_attention_2)."""
    if attention_mask is None:
        # A static cache hands over its whole buffer (kv_length = its capacity) while only the
        # first q_offset + q_length slots hold keys: say so with a mask, which the attention
        # function uses to cut the keys. (generate() keeps its mask for flash implementations.)
        end = int(q_offset) + int(q_length)
        if int(kv_offset) == 0 and end < kv_length:
            return torch.ones((batch_size, end), dtype=torch.bool, device=device)
        return None
    if attention_mask.dim() != 2:
        return attention_mask  # 4D masks are left to the attention function (which rejects them)
    mask = attention_mask[:, -kv_length:].bool()
    if mask.shape[-1] == kv_length and bool(mask.all()):
        return None
    return mask


# --------------------------------------------------------------------------------------------
# The attention function.


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return query.dtype


def flashtile_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                dropout: float = 0.0, scaling: Optional[float] = None,
                                sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                                is_causal: Optional[bool] = None, **kwargs):
    """transformers attention function: query (batch, heads, q_len, dim), key and value
    (batch, kv_heads, k_len, dim) -> ((batch, q_len, heads, dim) output, None)."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("flashtile's transformers attention does not support `position_bias`; "
                                  "use attn_implementation='eager' or 'sdpa' for this model")
    if kwargs.get("cache") is not None and type(kwargs["cache"]).__name__ == "PagedAttentionCache":
        raise NotImplementedError("flashtile's transformers attention does not support the paged cache of "
                                  "continuous batching")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)

    dtype = _compute_dtype(query)
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (query, key, value))  # (b, s, h, d) views
    batch, q_len, _, head_dim = q.shape
    v_head_dim = v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: values narrower than queries/keys
        if v_head_dim > head_dim:
            raise NotImplementedError(f"value head dim {v_head_dim} > query head dim {head_dim}")
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))

    window = (-1, -1)
    if sliding_window is not None and int(sliding_window) > 0:
        reach = int(sliding_window) - 1
        window = (reach, 0 if is_causal else reach)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = (torch.are_deterministic_algorithms_enabled()
                         or os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1")
    # s_aux goes in the model's own dtype: learnable_sink takes any floating dtype (some models keep it float32).
    options = dict(dropout_p=float(dropout or 0.0), softmax_scale=scaling, causal=is_causal,
                   window_size=window, softcap=float(softcap or 0.0), deterministic=bool(deterministic),
                   learnable_sink=kwargs.get("s_aux"))

    if attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, options)
    else:
        bounds = _varlen_kwargs(kwargs)
        if bounds is None and q_len > 1 and k.shape[1] == q_len and kwargs.get("position_ids") is not None:
            packed = _packed_bounds(kwargs["position_ids"], batch, q_len)
            if packed is not None:
                bounds = (packed[0], packed[0], packed[1], packed[1])
        if bounds is None:
            out = flashtile.flash_attn_func(q, k, v, **options)
        else:
            cu_q, cu_k, max_q, max_k = bounds
            flat = [t.reshape((-1,) + tuple(t.shape[2:])) for t in (q, k, v)]
            out = flashtile.flash_attn_varlen_func(*flat, cu_q, cu_k, max_q, max_k, **options)
            out = out.view(batch, q_len, *out.shape[1:])

    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _varlen_kwargs(kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) when the caller passed them
    (transformers' FlashAttentionKwargs), else None."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    values = [kwargs.get(n) for n in names]
    if any(x is None for x in values):
        return None
    cu_q, cu_k, max_q, max_k = values
    return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)


def _padded_attention(q, k, v, attention_mask: torch.Tensor, options) -> torch.Tensor:
    """Varlen attention over the tokens a 2D mask marks; padded query rows come back as zeros."""
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"flashtile's transformers attention takes a 2D padding mask (batch, keys), got a "
            f"{attention_mask.dim()}D mask {tuple(attention_mask.shape)}; custom 4D masks need "
            "attn_implementation='eager' or 'sdpa'")
    batch, q_len = q.shape[:2]
    mask = attention_mask.bool()
    k_len = k.shape[1]
    if mask.shape[1] > k_len:
        mask = mask[:, -k_len:]
    elif mask.shape[1] < k_len:  # static cache: its first mask.shape[1] slots hold the keys
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    if mask.shape[1] < q_len:
        raise ValueError(f"attention_mask covers {mask.shape[1]} keys but there are {q_len} queries")

    def compute():
        idx_k, cu_k, max_k = _unpad_indices(mask)
        if q_len == mask.shape[1]:
            return (idx_k, cu_k, max_k), (idx_k, cu_k, max_k)
        return _unpad_indices(mask[:, -q_len:]), (idx_k, cu_k, max_k)

    (idx_q, cu_q, max_q), (idx_k, cu_k, max_k) = _mask_memo.get(attention_mask, (q_len, k_len), compute)
    out = flashtile.flash_attn_varlen_func(_gather(q, idx_q), _gather(k, idx_k), _gather(v, idx_k),
                                           cu_q, cu_k, max_q, max_k, **options)
    return flashtile.pad_input(out, idx_q, batch, q_len)


# --------------------------------------------------------------------------------------------
# Registration.


def _seed_flash_import_cache(name: str) -> None:
    """transformers treats any implementation whose name contains "flash" as a flash-attention
    package and, when a model is built, imports that package through
    ``modeling_flash_attention_utils.lazy_import_flash_attention(name)``, which fails for names
    it does not know. It skips the import when ``name`` is the implementation it last loaded:
    record flashtile's functions there as that implementation. (Building a model with another
    flash implementation replaces the record: call register() again before the next model.)"""
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return
    needed = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
              "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn",
              "_lazy_define_process_function")
    if not all(hasattr(fa_utils, attr) for attr in needed):
        return  # a transformers release without that import cache: nothing to seed
    fa_utils._flash_fn = flashtile.flash_attn_func
    fa_utils._flash_varlen_fn = flashtile.flash_attn_varlen_func
    fa_utils._flash_with_kvcache_fn = flashtile.flash_attn_with_kvcache
    fa_utils._pad_fn = flashtile.pad_input
    fa_utils._unpad_fn = flashtile.unpad_input
    fa_utils._process_flash_kwargs_fn = fa_utils._lazy_define_process_function(flashtile.flash_attn_varlen_func)
    fa_utils._process_with_kvcache_kwargs_fn = fa_utils._lazy_define_process_function(
        flashtile.flash_attn_with_kvcache)
    fa_utils._loaded_implementation = name


# Models that pass attention sinks (s_aux) and list the flash kernels they accept
# (_compatible_flash_implementations): transformers sends any other "flash..." name to the first of those.
# Listed here after tests against the model's eager attention; model type -> the class holding the list.
SINK_MODELS = {"gpt_oss": "GptOssPreTrainedModel"}


def _list_as_compatible(name: str) -> None:
    """Add ``name`` to the accepted flash implementations of SINK_MODELS, so a model built with
    attn_implementation=name keeps it instead of being redirected to a hub kernel."""
    import importlib

    for model_type, class_name in SINK_MODELS.items():
        try:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:
            continue  # a release without that model
        cls = getattr(module, class_name, None)
        listed = getattr(cls, "_compatible_flash_implementations", None)
        if listed is not None and name not in listed:
            cls._compatible_flash_implementations = [*listed, name]


def _release(version: str) -> tuple:
    """(major, minor) of a version string such as 5.23.0.dev0."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def warn_if_untested(version: str) -> None:
    """A RuntimeWarning for transformers releases older than the tested ones: they route some calls
    of a "flash..." implementation through their own flash-attn loader, which fails there with an
    error about flash-attn, not about the version."""
    if _release(version) < OLDEST_TESTED:
        warnings.warn(f"flashtile.integrations.transformers is tested with transformers {TESTED_TRANSFORMERS}; "
                      f"this is {version}, where padded batches and generate() may fail inside transformers: "
                      "pip install 'flashtile[hf]'", RuntimeWarning, stacklevel=3)


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashtile with transformers as ``attn_implementation=name`` (attention function
    and mask function), for every model built afterwards. A name containing "flash" is also added to
    the flash implementations that the SINK_MODELS classes accept. Idempotent; returns ``name``."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError("flashtile.integrations.transformers needs transformers with the AttentionInterface "
                          f"API (tested: {TESTED_TRANSFORMERS}); pip install 'flashtile[hf]'") from e
    import transformers

    warn_if_untested(transformers.__version__)
    AttentionInterface.register(name, flashtile_attention_forward)
    AttentionMaskInterface.register(name, flashtile_attention_mask)
    if "flash" in name:
        _seed_flash_import_cache(name)
        _list_as_compatible(name)
    return name
