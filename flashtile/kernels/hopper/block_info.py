"""Which key blocks a query tile visits and which query blocks a key block visits, and which of them
need the mask (the causal diagonal, the ragged ends): the Hopper kernels' one home for tile ranges.
The forward's loader and consumers, and the backward's, must agree on these exactly.
(The portable kernels' counterpart is portable/scores.py's band_block_range.)"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def key_block_range(start_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr):
    """(n_unmasked, n_total): blocks [0, n_unmasked) need no mask, [n_unmasked, n_total) do."""
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        # Last key any row of the tile sees is start_m + BLOCK_M - 1 + diag.
        visible_end = gl.minimum(gl.maximum(start_m + BLOCK_M + diag, 0), seqlen_k)
        n_total = gl.cdiv(visible_end, BLOCK_N)
        # A block is mask-free when its last key is visible to the tile's first row.
        n_unmasked = gl.minimum(gl.maximum(start_m + diag + 1, 0) // BLOCK_N, seqlen_k // BLOCK_N)
    else:
        n_total = gl.cdiv(seqlen_k, BLOCK_N)
        n_unmasked = seqlen_k // BLOCK_N
    return n_unmasked, n_total


@gluon.jit
def key_block_band(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """A sliding window's key blocks for query rows [start_m, start_m + BLOCK_M): row i sees keys
    i + diag - window_left ..= i + diag + window_right (a causal window has window_right 0; an
    unbounded side is scores.UNBOUNDED_WINDOW). Returns (n_first, n_free_lo, n_free_hi, n_total):
    the tile visits blocks [n_first, n_total); a block in [n_free_lo, n_free_hi) lies inside every
    row's band and the sequence (no mask), the others cross an edge."""
    diag = seqlen_k - seqlen_q
    first = start_m + diag
    last = gl.minimum(start_m + BLOCK_M, seqlen_q) - 1 + diag
    n_first = gl.maximum(first - window_left, 0) // BLOCK_N
    n_total = gl.maximum(gl.cdiv(gl.minimum(gl.maximum(last + window_right + 1, 0), seqlen_k), BLOCK_N), n_first)
    # Free: its first key is in the last row's band, its last key in the first row's and the sequence.
    n_free_lo = gl.cdiv(gl.maximum(last - window_left, 0), BLOCK_N)
    n_free_hi = gl.minimum(gl.maximum(first + window_right + 1, 0) // BLOCK_N, seqlen_k // BLOCK_N)
    return n_first, n_free_lo, n_free_hi, n_total


@gluon.jit
def key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr, HAS_SEQUSED_Q: gl.constexpr,
               QUERY_GROUP: gl.constexpr = 1):
    """(n_first, n_free_lo, n_free_hi, n_total) of a forward tile (see key_block_band): with a window
    (LOCAL) its band, else key_block_range's blocks from 0 with the free ones first; no key block at
    all for a tile wholly past the used rows. QUERY_GROUP: rows per query position (a GQA group's
    query heads packed as rows, row r at position r // QUERY_GROUP; a power of two dividing 64): the
    ranges are those of the tile's positions."""
    if QUERY_GROUP > 1:
        start_m = start_m // QUERY_GROUP
        seqlen_q = seqlen_q // QUERY_GROUP
    POSITIONS: gl.constexpr = BLOCK_M // QUERY_GROUP
    if LOCAL:
        n_first, n_free_lo, n_free_hi, n_total = key_block_band(start_m, seqlen_q, seqlen_k, window_left,
                                                                window_right, POSITIONS, BLOCK_N)
    else:
        n_free_hi, n_total = key_block_range(start_m, seqlen_q, seqlen_k, POSITIONS, BLOCK_N, CAUSAL)
        n_first = 0
        n_free_lo = 0
    if HAS_SEQUSED_Q:
        n_total = gl.where(start_m < seqlen_q, n_total, 0)
        n_first = gl.minimum(n_first, n_total)
        n_free_hi = gl.minimum(n_free_hi, n_total)
    return n_first, n_free_lo, n_free_hi, n_total


@gluon.jit
def query_block_range(start_n, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, LOCAL: gl.constexpr = False, window_left=0, window_right=0):
    """(m_lo, m_full, m_tail, m_end): query blocks [m_lo, m_full) and [m_tail, m_end) need the
    mask, [m_full, m_tail) do not. LOCAL: a sliding window (key_block_band's sides; CAUSAL off)."""
    m_end = gl.cdiv(seqlen_q, BLOCK_M)
    diag = seqlen_k - seqlen_q
    if LOCAL:
        # Query i sees key j iff j - diag - window_right <= i <= j - diag + window_left: the block is
        # seen by rows start_n - diag - window_right ..= start_n + BLOCK_N - 1 - diag + window_left,
        # and wholly by rows start_n + BLOCK_N - 1 - diag - window_right ..= start_n - diag + window_left.
        m_end = gl.minimum(gl.cdiv(gl.maximum(start_n + BLOCK_N - diag + window_left, 0), BLOCK_M), m_end)
        m_lo = gl.minimum(gl.maximum(start_n - diag - window_right, 0) // BLOCK_M, m_end)
        m_full = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - diag - window_right, 0), BLOCK_M),
                                       m_end), m_lo)
        free_end = gl.maximum(start_n - diag + window_left + 1, 0) // BLOCK_M
    elif CAUSAL:
        # Query i sees key j iff j <= i + diag: the block's first key is seen from row start_n - diag,
        # all its keys from row start_n + BLOCK_N - 1 - diag on.
        m_lo = gl.minimum(gl.maximum(start_n - diag, 0) // BLOCK_M, m_end)
        m_full = gl.minimum(gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M), m_end)
    else:
        m_lo = 0
        m_full = 0
    if start_n + BLOCK_N > seqlen_k:
        # Ragged key block: keys past seqlen_k (zero-filled K) must not get probability mass.
        m_full = m_end
    # A ragged last query block is masked too: its lse / delta boxes run into the next head's rows.
    if LOCAL:
        m_tail = gl.maximum(m_full, gl.minimum(free_end, seqlen_q // BLOCK_M))
    else:
        m_tail = gl.maximum(m_full, seqlen_q // BLOCK_M)
    return m_lo, m_full, m_tail, m_end
