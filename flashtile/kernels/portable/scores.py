"""The score pipeline, written once for the forward and backward kernels.

Order (flash_attn's): s = q.k * scale -> softcap -> + ALiBi bias -> the user's score_mod ->
causal / window / bounds mask and the user's mask_mod. Scores are kept in log2 units (log2(e) folded
into the scale) so the softmax uses exp2; the mods see natural units.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): exact at both ends (e^{2x} -> inf gives 1, -> 0 gives -1).
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def scores_log2(qk, rows, cols, diag, qk_scale, softcap_log2, alibi_slope_log2,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw dot products ``qk`` (fp32 tile) -> scores in log2 units.

    Also returns ``t = tanh(q.k * scale / softcap)`` (the backward's softcap derivative
    is ``1 - t^2``); without softcap ``t`` is meaningless.
    qk_scale: softmax_scale * log2(e), or softmax_scale / softcap when capping.
    softcap_log2: softcap * log2(e). alibi_slope_log2: slope * log2(e) for this (batch, head).
    diag = seqlen_k - seqlen_q: query row i lines up with key column i + diag.
    """
    if HAS_SOFTCAP:
        t = tanh(qk * qk_scale)
        s = t * softcap_log2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        distance = tl.abs(rows[:, None] + diag - cols[None, :]).to(tl.float32)
        s = s - alibi_slope_log2 * distance
    return s, t


@triton.jit
def mask_scores(s, rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """-inf outside the sequence bounds and outside the band
    ``i + diag - window_left <= j <= i + diag + window_right`` (causal is right = 0)."""
    keep = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    if HAS_RIGHT:
        keep = keep & (cols[None, :] <= rows[:, None] + diag + window_right)
    if HAS_LEFT:
        keep = keep & (cols[None, :] >= rows[:, None] + diag - window_left)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def mod_positions(rows, cols, seqlen_q, seqlen_k, KEYS_FIRST: tl.constexpr, CLAMP_LOOP: tl.constexpr = True):
    """(q_idx, kv_idx): the positions a score or mask mod sees, clamped into the sequence (a mod may
    index its aux tensors with them; the clamped rows and columns are masked off anyway). A column
    and a row of a queries-by-keys tile, or with KEYS_FIRST a row and a column (the dK/dV kernel's
    keys-by-queries tiles). The program's own axis (queries; keys with KEYS_FIRST) is always
    clamped; the axis its loop walks only with CLAMP_LOOP: unmasked tiles lie inside the sequence,
    and unclamped positions keep their contiguity, which vectorizes the mods' loads along them."""
    q_idx = rows
    kv_idx = cols
    if KEYS_FIRST or CLAMP_LOOP:
        kv_idx = tl.minimum(cols, tl.maximum(seqlen_k - 1, 0))
    if (not KEYS_FIRST) or CLAMP_LOOP:
        q_idx = tl.minimum(rows, tl.maximum(seqlen_q - 1, 0))
    if KEYS_FIRST:  # one return for both layouts: the compiler wants one return type
        q_idx = q_idx[None, :]
        kv_idx = kv_idx[:, None]
    else:
        q_idx = q_idx[:, None]
        kv_idx = kv_idx[None, :]
    return q_idx, kv_idx


@triton.jit
def score_mod_log2(s, b, h, q_idx, kv_idx, SCORE_MOD: tl.constexpr, score_aux):
    """The user's score_mod on log2-unit scores ``s``: it sees and returns natural units (the scale,
    softcap and ALiBi applied). Returns (the modded scores in log2 units, the mod's input, which the
    backward's score_mod_bwd takes)."""
    s_in = s * LN2
    return SCORE_MOD(s_in, b, h, q_idx, kv_idx, score_aux) * LOG2E, s_in


@triton.jit
def mask_mod_scores(s, b, h, q_idx, kv_idx, MASK_MOD: tl.constexpr, mask_aux):
    """-inf where the user's mask_mod says a query does not see a key."""
    return tl.where(MASK_MOD(b, h, q_idx, kv_idx, mask_aux), s, float("-inf"))


@triton.jit
def listed_tile_start(block_list, t, MASK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """The first row (or key) of tile t of the blocks a block mask lists: the blocks of MASK_BLOCK
    are walked in BLOCK-sized tiles, in the list's order."""
    tiles_per_block: tl.constexpr = MASK_BLOCK // BLOCK
    return tl.load(block_list + t // tiles_per_block) * MASK_BLOCK + (t % tiles_per_block) * BLOCK


@triton.jit
def band_block_range(start, n_rows, n_cols, diag, window_left, window_right,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which column blocks the row block [start, start + BLOCK_ROWS) must visit.

    Row r sees columns r + diag - window_left .. r + diag + window_right. Returns
    (lo, full_lo, full_hi, hi): blocks in [lo, full_lo) and [full_hi, hi) cross an
    edge of the band or of the matrix and need element masks; blocks in
    [full_lo, full_hi) are entirely inside and skip them. Blocks outside [lo, hi)
    are never loaded. lo, full_lo and full_hi are multiples of BLOCK_COLS.

    The forward and dQ kernels call it with rows = queries; the dK/dV kernel with
    rows = keys (diag negated, left and right swapped).
    """
    first_row = start
    last_row = tl.minimum(start + BLOCK_ROWS, n_rows) - 1
    lo = 0
    hi = n_cols
    if HAS_LEFT:
        lo = tl.maximum(first_row + diag - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(last_row + diag + window_right + 1, n_cols)
    lo = (lo // BLOCK_COLS) * BLOCK_COLS
    hi = tl.maximum(hi, lo)
    # A block needs no mask when its first column is inside every row's left edge,
    # its last column inside every row's right edge, and it ends within n_cols.
    full_lo = lo
    if HAS_LEFT:
        full_lo = tl.cdiv(tl.maximum(last_row + diag - window_left, 0), BLOCK_COLS) * BLOCK_COLS
    full_hi = (n_cols // BLOCK_COLS) * BLOCK_COLS
    if HAS_RIGHT:
        right_edge = tl.maximum(first_row + diag + window_right + 1, 0)
        full_hi = tl.minimum(full_hi, (right_edge // BLOCK_COLS) * BLOCK_COLS)
    # Clamped to hi's block start, not to hi: the loops start at lo, full_lo and full_hi, and bounds the
    # compiler can see are multiples of BLOCK_COLS keep the column positions aligned, so that loads
    # along them vectorize (a mod's, the attn_bias gradient's atomics). A causal edge, last_row + diag
    # + 1, is not such a multiple: with hi here, the causal attn_bias forward's bias loads went scalar
    # and left the software pipeline (docs/experiments.md). The tile at hi's block start, if partial,
    # goes to the masked loop after the middle.
    hi_block = (hi // BLOCK_COLS) * BLOCK_COLS
    full_lo = tl.minimum(full_lo, hi_block)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_block)
    return lo, full_lo, full_hi, hi
