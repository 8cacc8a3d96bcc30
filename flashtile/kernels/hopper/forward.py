"""Hopper (sm90) forward attention in Gluon, FlashAttention-3 style.

One CTA owns a tile of NUM_CONSUMERS * 64 query rows of one (batch, head):
  * a loader partition (1 warp) streams K and V tiles with TMA into a NUM_STAGES ring,
    each slot guarded by a "ready" mbarrier (TMA bytes landed) and an "empty" mbarrier
    (every consumer warpgroup finished reading it);
  * each consumer partition (1 to 4) is one warpgroup owning 64 query rows. It computes
    S = Q K^T with wgmma from shared memory and O += P V with P kept in registers (wgmma
    register A operand, no shared-memory round trip). The wgmmas are async: S_{j+1} = Q K_{j+1}^T
    and O += P_j V_j are in flight while the softmax of block j+1 runs (FA3 intra-warpgroup
    overlap). The consumer warpgroups run independently, so one's softmax naturally overlaps
    another's wgmmas; with one consumer per CTA, several CTAs share an SM (GluonFwdConfig.ctas_per_sm)
    and overlap the same way, each with its own tiles and K/V stream.
Only the key blocks that can hold masked entries (the causal diagonal, the ragged end at sk)
pay for the mask; causal blocks wholly above the diagonal are never loaded. With trim_diagonal
(causal, head dim 64), a warpgroup whose rows see only the first half of the tile's last key block
multiplies just that half (64 x 64 products instead of 64 x 128). With own_key_range (causal, no
ping-pong), each warpgroup multiplies only the key blocks its own 64 rows see and masks only those
its rows cut: in a 4 x 64-row tile with 64-key blocks the first warpgroup skips 3 blocks the last
one needs, and hands their ring slots back unread.

Varlen (IS_VARLEN, flash_attn_varlen_func's packed layout): the host passes the packed tensors as
batch-1 views (1, total, h, d), so the same 4-D descriptors serve; the grid's third axis is the
sequence, whose offsets and lengths each partition reads from cu_seqlens (and seqused). TMA
coordinates are offset by the sequence start; key tiles past the sequence end read the next
sequence's keys and are masked like the ragged end of a dense row. Query rows past the end are
computed but not stored: a sequence's last, ragged 64-row tile is stored from registers with a row
mask (a TMA box would overwrite the next sequence's rows), every other tile by TMA. The dense
path compiles to the same code as without varlen (all of it sits behind the constexpr).

seqused_k (varlen, or a dense kv cache (b, capacity, hk, d)): a sequence's slots past its used keys may
hold anything, NaN included, and 0 * NaN is NaN. Their scores are masked by a select, so K needs nothing;
the loader zeroes V's rows past the end in the one block that crosses it, between that block's TMA and
its ready barrier (_load_v_upto). Without seqused_k the kernel compiles to the same code.

A kv cache's pages (block_table): K and V are (num_pages, page_size, hk, d), and the loader finds each key
block's page in the sequence's row of the table (_key_page) a block ahead, so the load hides behind a block.
Pages hold a multiple of BLOCK_N keys, so no block spans two; or the table has one page per sequence (a
contiguous cache whose rows cache_batch_idx picks, or left-padded: key_shift), whose blocks may start
anywhere in it. The consumers see only the sequence's own key positions.

Packed GQA rows (QUERY_GROUP = g > 1, a decode-shaped call of a few query rows per sequence): each kv
head's group of g query heads are the rows of its tiles (row r of kv head hk is query head hk * g + r % g
at position r // g), so one tile's K/V blocks serve the whole group. The kernel sees hk "heads" of s * g
rows; Q and O move through 5-D TMA boxes (1, 64 / g, 1, g, d) over q and out as (b, s, hk, g, d), whose
shared-memory image is the (64, d) tile of those rows, and lse is stored by (head, position). The masks
and block ranges see positions (r // g). A packed sequence's rows are its positions times g.

Head dims 96 and 192 (HEAD_DIM_TRUE) run the d128 and d256 kernels: the TMA boxes keep the padded
width over the true-width tensors, so loads zero-fill the missing columns (S is exact, O's padded
columns come out zero) and stores clip them; the ragged-tile register store masks them. At d192 the
S product skips the all-zero last 64 columns. d64/d128/d256 compile to the same code as before.

attn_bias (BIAS): when TMA can address the bias, the loader brings each consumer's (64 rows x key block)
tile of it with the block's K, into a ring of its own beside K's (same slots, same barriers); each
consumer warpgroup reads its tile while the block's S is in flight. Otherwise each warpgroup loads its
rows of the block's bias then (scores.attn_bias_tile). Either way the softmax adds it; with it, a row
may see only -inf in any block, so the softmax guards its max as masked blocks do.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...triton_compat import barrier, reinterpret, tma_load, tma_store
from .block_info import key_blocks
from .scores import (LN2, LOG2E, alibi_slope_log2, attn_bias_head, attn_bias_log2, attn_bias_rows, attn_bias_tile,
                     modded_scores_log2, relative_bias_far_entry, relative_bias_log2, relative_bias_row)
from .seqlen_info import forward_tile
from .sink import fold_sink, load_sink_log2

# wgmma's M per warpgroup; each consumer warpgroup owns this many query rows.
ROWS_PER_CONSUMER = 64


@gluon.jit
def _dense_units(seqlen_q, nheads, n_batch, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """Work units of a persistent CTA's dense schedule: a query tile, or when causal a pair of
    tiles of one head (the longest with the shortest, the second longest with the second
    shortest, ...) whose key blocks add up to the same count, so that CTAs taking units round
    robin finish together."""
    tiles_m = gl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
        tiles_m = (tiles_m + 1) // 2
    return tiles_m * nheads * n_batch


@gluon.jit
def _unit_tiles(u, seqlen_q, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """Tiles in unit u: 1, or 2 for causal pairs (the middle tile of an odd count is alone)."""
    if CAUSAL:
        tiles_m = gl.cdiv(seqlen_q, BLOCK_M)
        per_head = (tiles_m + 1) // 2
        alone = ((tiles_m % 2) == 1) & ((u % per_head) == per_head - 1)
        n = gl.where(alone, 1, 2)
    else:
        n = 1
    return n


@gluon.jit
def _dense_tile(u, half, seqlen_q, nheads, head_group, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(start_m, head, kv head, batch) of tile ``half`` of unit u. Units of one head are
    consecutive (CTAs running side by side share that head's K/V in L2)."""
    tiles_m = gl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
        per_head = (tiles_m + 1) // 2
        k = u % per_head
        head_batch = u // per_head
        pid_m = gl.where(half == 0, tiles_m - 1 - k, k)
    else:
        pid_m = u % tiles_m
        head_batch = u // tiles_m
    head = head_batch % nheads
    return pid_m * BLOCK_M, head, head // head_group, head_batch // nheads


@gluon.jit
def _chunk_start(start_m, c, reverse, NUM_CONSUMERS: gl.constexpr):
    """First row of warpgroup c's 64 rows in the tile from start_m: chunk c, or with ``reverse`` chunk
    NUM_CONSUMERS - 1 - c. Persistent causal pairs with own key ranges reverse their second tile, so
    the warpgroup with the fewest key blocks in one tile has the most in the other: every warpgroup
    then multiplies the same number of blocks per pair (4k + c + 1 and 4(n - 1 - k) + (3 - c) + 1)."""
    row = start_m + c * 64
    if reverse:
        row = start_m + (NUM_CONSUMERS - 1 - c) * 64
    return row


# ----------------------------------------------------------------------------------------------
# Loader partition: Q once, then the K/V ring.
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _load_tiles(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                v_empty, tma_batch, q_row, k_start, head, kv_head, n_total, kv0, q_phase, reverse,
                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                PERSISTENT: gl.constexpr, bias_desc=None, bias_smem=None, bias_origin=None,
                QUERY_GROUP: gl.constexpr = 1, v_fix=None, key_end=0, table_row=None, page_size=1):
    """Q of one tile, then its n_total K/V blocks. kv0: K/V blocks this CTA loaded before (the ring
    position); q_phase: tiles before, mod 2 (persistent CTAs wait until the consumers released the
    previous tile's Q); reverse: see _chunk_start. With bias_desc, each K slot also takes every
    consumer's (64 rows x key block) tile of attn_bias into bias_smem (see the kernel); bias_origin: the
    bias's (batch, head, query, key) coordinates of the tile's first row and first block.
    v_fix (a barrier; one tile per CTA): the rows of V at key_end (a key coordinate) and past it may hold
    anything (seqused_k: a kv cache's free slots) and are zeroed in the block that crosses it (_load_v_upto).
    table_row (a pointer into a block table; None: K and V are read at [tma_batch, key]): key t lives at row
    t % page_size of page table_row[t // page_size] (_key_page)."""
    BIAS_RING: gl.constexpr = bias_desc is not None
    if BIAS_RING:
        k_bytes: gl.constexpr = k_desc.block_type.nbytes + NUM_CONSUMERS * bias_desc.block_type.nbytes
        bias_b, bias_h, bias_m, bias_n = bias_origin
    else:
        k_bytes: gl.constexpr = k_desc.block_type.nbytes
    for c in gl.static_range(NUM_CONSUMERS):
        if PERSISTENT:
            mbarrier.wait(q_empty.index(c), q_phase ^ 1)
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        row = _chunk_start(q_row, c, reverse, NUM_CONSUMERS)
        if QUERY_GROUP > 1:
            tma_load(q_desc, [tma_batch, row // QUERY_GROUP, head, 0, 0], q_ready.index(c), q_smem.index(c))
        else:
            tma_load(q_desc, [tma_batch, row, head, 0], q_ready.index(c), q_smem.index(c))

    if table_row is not None:
        next_page, next_row = _key_page(k_start, table_row, page_size)
    for jj in range(n_total):
        j = kv0 + jj
        stage = j % NUM_STAGES
        if table_row is not None:
            # Pages are looked up a block ahead: the table load's latency hides behind this block's waits.
            page, row = next_page, next_row
            next_page, next_row = _key_page(k_start + gl.minimum(jj + 1, n_total - 1) * BLOCK_N, table_row,
                                            page_size)
        else:
            page, row = tma_batch, k_start + jj * BLOCK_N
        # Waiting on the opposite parity passes at once on a fresh barrier (first lap).
        empty_phase = ((j // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), empty_phase)
        mbarrier.expect(k_ready.index(stage), k_bytes)
        tma_load(k_desc, [page, row, kv_head, 0], k_ready.index(stage), k_smem.index(stage))
        if BIAS_RING:
            # TMA zero-fills rows and keys past the bias (their scores are discarded or masked).
            for c in gl.static_range(NUM_CONSUMERS):
                tma_load(bias_desc, [bias_b, bias_h, _chunk_start(bias_m, c, reverse, NUM_CONSUMERS),
                                     bias_n + jj * BLOCK_N], k_ready.index(stage),
                         bias_smem.index(c * NUM_STAGES + stage))
        mbarrier.wait(v_empty.index(stage), empty_phase)
        if v_fix is not None:
            if key_end - (k_start + jj * BLOCK_N) < BLOCK_N:
                _load_v_upto(v_desc, v_smem.index(stage), v_fix, v_ready.index(stage), [page, row, kv_head, 0],
                             key_end - (k_start + jj * BLOCK_N))
            else:
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                tma_load(v_desc, [page, row, kv_head, 0], v_ready.index(stage), v_smem.index(stage))
        else:
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [page, row, kv_head, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _key_page(key, table_row, page_size):
    """The K/V TMA coordinates (page, row) of a key block starting at key, through the table's row (one page
    per sequence, or pages of a multiple of the block's keys: a block never spans two pages)."""
    index = key // page_size
    return gl.load(table_row + index), key - index * page_size


@gluon.jit
def _load_v_upto(v_desc, v_buf, v_fix, v_ready, coords, used_rows):
    """One V block of which only the first used_rows rows may be read: the loader waits for its TMA
    (on v_fix), zeroes the other rows and then marks the slot ready. Their probabilities are 0, but
    0 * NaN is NaN, and K's rows there need nothing (their scores are masked by a select)."""
    BLOCK_N: gl.constexpr = v_buf.shape[1]
    V_DIM: gl.constexpr = v_buf.shape[3]
    mbarrier.expect(v_fix, v_desc.block_type.nbytes)
    tma_load(v_desc, coords, v_fix, v_buf)
    mbarrier.wait(v_fix, 0)
    tile = v_buf.reshape([BLOCK_N, V_DIM])
    # 8 rows x 64 columns at a time (a swizzle atom's rows, one 128-byte swizzle span): 16 values a thread.
    chunk_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, chunk_layout))
    for r0 in gl.static_range(0, BLOCK_N, 8):
        if r0 + 8 > used_rows:
            for c0 in gl.static_range(0, V_DIM, 64):
                chunk = tile.slice(r0, 8, dim=0).slice(c0, 64, dim=1)
                values = chunk.load(chunk_layout)
                chunk.store(gl.where(gl.expand_dims(rows + r0 < used_rows, 1), values, gl.zeros_like(values)))
    # The stores reach the wgmmas (the async proxy) before the slot is marked ready.
    fence_async_shared()
    barrier()
    mbarrier.arrive(v_ready)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
            v_fix, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group, n_batch,
            heads_per_group, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr,
            IS_VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, OWN_KEY_RANGE: gl.constexpr, QUERY_GROUP: gl.constexpr,
            bias_desc=None, bias_smem=None, bias_batches=1, bias_heads=1, block_table=None, stride_table=0,
            page_size=1, table_keys=0, key_shift=None):
    # bias_desc: attn_bias's tiles come through the K ring (_load_tiles); bias_batches, bias_heads: its batch
    # and head dims (1 where it broadcasts). v_fix: with seqused_k or pages, the barrier _load_v_upto waits on
    # (one tile per CTA: the host keeps such calls off the persistent grid). block_table (rows stride_table apart,
    # each addressing table_keys keys), page_size, key_shift: K and V through a table of pages (forward_tile).
    if PERSISTENT:
        kv0 = 0
        tile_iter = 0
        for u in range(gl.program_id(0), _dense_units(seqlen_q, nheads, n_batch, BLOCK_M, CAUSAL),
                       gl.num_programs(0)):
            for half in range(_unit_tiles(u, seqlen_q, BLOCK_M, CAUSAL)):
                start_m, head, kv_head, batch = _dense_tile(u, half, seqlen_q, nheads, head_group, BLOCK_M, CAUSAL)
                n_first, _, _, n_total = key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M,
                                                    BLOCK_N, CAUSAL, LOCAL, False, QUERY_GROUP)
                reverse = False
                if OWN_KEY_RANGE:
                    reverse = half == 1
                _load_tiles(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, batch, start_m, n_first * BLOCK_N, head, kv_head, n_total - n_first,
                            kv0, tile_iter & 1, reverse, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, True, bias_desc,
                            bias_smem, (batch % bias_batches, head % bias_heads, start_m, n_first * BLOCK_N),
                            QUERY_GROUP)
                kv0 += n_total - n_first
                tile_iter += 1
    else:
        start_m, head, kv_head, batch, q_start, k_start, seqlen_q, seqlen_k, rows_end, valid = forward_tile(
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, head_group, heads_per_group,
            BLOCK_M, CAUSAL, IS_VARLEN, QUERY_GROUP, block_table, key_shift, table_keys)
        n_first, _, _, n_total = key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                            CAUSAL, LOCAL, seqused_q is not None, QUERY_GROUP)
        # A window's tile starts at its first visible key block.
        first_key = n_first * BLOCK_N
        # Key blocks running past the sequence read the next one's keys (varlen), or past the tensor TMA's
        # zeros (masked by the consumers); past seqused_k, a cache's free slots, and past the keys in a
        # sequence's last page: V's are zeroed.
        v_tail = v_fix if seqused_k is not None else None
        table_row = None
        if block_table is not None:  # k_start: the sequence's first key in its pages
            table_row = block_table + batch * stride_table
            v_tail = v_fix
        if IS_VARLEN:
            if valid:
                _load_tiles(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, 0, q_start + start_m, k_start + first_key, head, kv_head,
                            n_total - n_first, 0, 0, False, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, False, bias_desc,
                            bias_smem, (batch % bias_batches, head % bias_heads, start_m, first_key), QUERY_GROUP,
                            v_tail, k_start + seqlen_k, table_row, page_size)
        else:
            _load_tiles(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                        v_ready, v_empty, batch, start_m, k_start + first_key, head, kv_head, n_total - n_first, 0,
                        0, False, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, False, bias_desc, bias_smem,
                        (batch % bias_batches, head % bias_heads, start_m, first_key), QUERY_GROUP, v_tail,
                        k_start + seqlen_k, table_row, page_size)


# ----------------------------------------------------------------------------------------------
# Consumer partition: one warpgroup, 64 query rows.
# ----------------------------------------------------------------------------------------------

@gluon.jit
def _softmax_block(s, m_i, l_i, rows, start_n, seqlen_k, diag, qk_scale_log2, score, bias,
                   BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, REL_BIAS: gl.constexpr, BIAS: gl.constexpr,
                   s_layout: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """Online-softmax update for one score block (keys from start_n). Returns (p, alpha, m_new,
    l_new); m is in scaled log2 units so p = exp2(s * scale - m) is one FMA + exp2. ROW_SUM_MMA: l
    is the tensor cores' (see _consume) and comes back as it came. MASK: keys past the ragged end
    and, when CAUSAL, past the row's diagonal (rows + diag, bottom-right aligned), and with a window
    (LOCAL) outside the row's band, count as -inf. score: (ALiBi slope, softcap scale, softcap,
    window left, window right, relative-bias row, its distance, the slice's first row, attn_bias's row
    pointers) of SOFTCAP / ALIBI / LOCAL / REL_BIAS / BIAS (scores.py). bias: with BIAS, the block's
    attn_bias tile as loaded (scores.attn_bias_tile, while S was in flight), else 0."""
    slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, row0, bias_rows = score
    offsets = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # BIAS 3: S's start held the bias; a row may still have seen only -inf so far (EMPTY_ROWS).
    MODDED: gl.constexpr = SOFTCAP or ALIBI or REL_BIAS or (BIAS != 0 and BIAS != 3)
    if REL_BIAS and not ALIBI and not MASK:
        # A block beyond the table's distance from every row adds one entry to all its scores: the
        # entry joins the row max instead (as the scale does), and the scores stay raw.
        entry = relative_bias_far_entry(start_n - (row0 + 63), start_n + (BLOCK_N - 1) - row0, rel_distance)
        if entry >= 0:
            row_term = gl.full(rows.shape, 0.0, gl.float32, rows.type.layout) + gl.load(rel_row + entry) * LOG2E
            if SOFTCAP:
                s, _ = modded_scores_log2(s, 0, qk_scale_log2, softcap_scale, softcap_log2, 0.0, True, False)
                p, alpha, m_new, l_new = _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diag, 1.0, row_term,
                                                         window_left, window_right, BLOCK_N, MASK, CAUSAL, LOCAL,
                                                         s_layout, ROW_SUM_MMA)
            else:
                p, alpha, m_new, l_new = _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diag, qk_scale_log2,
                                                         row_term, window_left, window_right, BLOCK_N, MASK, CAUSAL,
                                                         LOCAL, s_layout, ROW_SUM_MMA)
        else:
            s = _modded_scores(s, rows, start_n, diag, qk_scale_log2, score, bias, offsets, SOFTCAP, ALIBI, REL_BIAS,
                               BIAS)
            p, alpha, m_new, l_new = _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diag, 1.0, None,
                                                     window_left, window_right, BLOCK_N, MASK, CAUSAL, LOCAL,
                                                     s_layout, ROW_SUM_MMA)
    elif MODDED:
        s = _modded_scores(s, rows, start_n, diag, qk_scale_log2, score, bias, offsets, SOFTCAP, ALIBI, REL_BIAS, BIAS)
        # A bias may hold -inf: a row can then have no visible key so far in any block, masked or not.
        p, alpha, m_new, l_new = _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diag, 1.0, None, window_left,
                                                 window_right, BLOCK_N, MASK, CAUSAL, LOCAL, s_layout, ROW_SUM_MMA,
                                                 BIAS != 0)
    else:
        p, alpha, m_new, l_new = _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diag, qk_scale_log2, None,
                                                 window_left, window_right, BLOCK_N, MASK, CAUSAL, LOCAL, s_layout,
                                                 ROW_SUM_MMA, BIAS == 3)
    return p, alpha, m_new, l_new


@gluon.jit
def _modded_scores(s, rows, start_n, diag, qk_scale_log2, score, bias, offsets, SOFTCAP: gl.constexpr,
                   ALIBI: gl.constexpr, REL_BIAS: gl.constexpr, BIAS: gl.constexpr):
    """Raw dot products -> the options' scores in log2 units, element by element (scores.py); bias: the
    block's attn_bias tile as loaded (BIAS)."""
    slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, row0, bias_rows = score
    offset = gl.expand_dims(rows + diag - start_n, 1) - gl.expand_dims(offsets, 0)
    s, _ = modded_scores_log2(s, offset, qk_scale_log2, softcap_scale, softcap_log2, slope_log2, SOFTCAP, ALIBI)
    if REL_BIAS:
        # The slice's 64 rows from row0 against keys start_n + offsets.
        BLOCK_N: gl.constexpr = offsets.shape[0]
        entry = relative_bias_far_entry(start_n - (row0 + 63), start_n + (BLOCK_N - 1) - row0, rel_distance)
        s = relative_bias_log2(s, gl.expand_dims(offsets + start_n, 0), gl.expand_dims(rows, 1), entry, rel_row,
                               rel_distance)
    if BIAS != 0 and BIAS != 3:
        s = s + attn_bias_log2(bias)
    return s


@gluon.jit
def _online_softmax(s, m_i, l_i, rows, start_n, seqlen_k, diag, scale, row_term, window_left, window_right,
                    BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr,
                    s_layout: gl.constexpr, ROW_SUM_MMA: gl.constexpr, EMPTY_ROWS: gl.constexpr = False):
    """The softmax step of _softmax_block on scores s * scale + row_term (log2 units; scale > 0, a
    constant 1.0 for scores already scaled; row_term: None, or a value per row). EMPTY_ROWS: a row may
    have seen only -inf scores so far in unmasked blocks too (MASK implies it)."""
    if MASK:
        # One compare per score: the column's offset in the block (a constant per thread) against
        # the row's last visible key, moved into the block. Comparing absolute key indices with
        # the end and the diagonal separately cost the d64 loop 137 more instructions per block.
        offsets = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        last_key = gl.full(rows.shape, 0, gl.int32, rows.type.layout) + (seqlen_k - 1)
        if CAUSAL:
            last_key = gl.minimum(last_key, rows + diag)
        if LOCAL:
            last_key = gl.minimum(last_key, rows + diag + window_right)
        keep = gl.expand_dims(offsets, 0) <= gl.expand_dims(last_key - start_n, 1)
        if LOCAL:
            keep = keep & (gl.expand_dims(offsets, 0) >= gl.expand_dims(rows + diag - window_left - start_n, 1))
        s = gl.where(keep, s, float("-inf"))
    # max(s) * scale is the max of the scaled scores because the scale is positive (the host sends
    # other scales to the portable kernels).
    if row_term is None:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale + row_term)
    if MASK or EMPTY_ROWS:
        # A row with every key masked so far keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if row_term is None:
        p = gl.exp2(s * scale - gl.expand_dims(m_use, 1))
    else:
        p = gl.exp2(s * scale - gl.expand_dims(m_use - row_term, 1))
    alpha = gl.exp2(m_i - m_use)
    if ROW_SUM_MMA:
        l_new = l_i
    else:
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _probabilities_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """P rounded to dtype as the register A operand of P V. The conversion packs each pair of
    neighbouring columns into one register in the order wgmma reads them (low half first); with
    p.to(dtype), ptxas packed them the other way round and spent a PRMT per register swapping
    the halves back before every P V."""
    if dtype == gl.bfloat16:
        packed = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                           is_pure=True, pack=2)
    else:
        packed = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                           is_pure=True, pack=2)
    return gl.convert_layout(packed, p_layout)


@gluon.jit
def _scores_skipping_zero_chunk(q_buf, k_buf, s_zero):
    """S = Q K^T over the first 192 columns of 256-wide Q, K tiles (q_buf, k_buf: the (1, rows, 1, 256)
    TMA tiles; Q's (1, rows / g, 1, g, 256) with packed GQA rows) whose last 64 columns are TMA zero fill
    (head dims 136..192): one wgmma over columns [0, 128), one over [128, 192), both async. A 256-wide
    box lands as 4 chunks of 64 columns (128-byte swizzle), so columns [0, 128) are one (rows, 128) view
    and chunk 2 a (rows, 64) one."""
    dtype: gl.constexpr = q_buf.dtype
    ROWS: gl.constexpr = q_buf.shape[1] * q_buf.shape[-2]
    BLOCK_N: gl.constexpr = k_buf.shape[1]
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lo = reinterpret(q_buf, dtype, [2, ROWS, 128], layout).index(0)
    k_lo = reinterpret(k_buf, dtype, [2, BLOCK_N, 128], layout).index(0)
    q_hi = reinterpret(q_buf, dtype, [4, ROWS, 64], layout).index(2)
    k_hi = reinterpret(k_buf, dtype, [4, BLOCK_N, 64], layout).index(2)
    s_tok = warpgroup_mma(q_lo, k_lo.permute([1, 0]), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(q_hi, k_hi.permute([1, 0]), s_tok, is_async=True)


@gluon.jit
def _ring_bias_tile(bias_rows, stage, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """This warpgroup's attn_bias tile (64 x BLOCK_N, as stored) in ring slot ``stage``; bias_rows holds the
    ring and the warpgroup's first tile in it."""
    ring, first = bias_rows
    return ring.index(first + stage).reshape([64, BLOCK_N]).load(s_layout)


@gluon.jit
def _block_bias(score, start_n, seqlen_k, stage, BLOCK_N: gl.constexpr, MASK: gl.constexpr, BIAS: gl.constexpr,
                s_layout: gl.constexpr):
    """The attn_bias tile of the block from key start_n (in ring slot ``stage``) as stored, for the softmax to
    add, or 0 (no bias, or BIAS 3: S's start holds it): BIAS 2 reads it from the ring (the score tuple holds
    the ring and this warpgroup's first tile in it), BIAS 1 loads it (scores.attn_bias_tile; the tuple holds
    its rows' pointers), BIAS 4 loads the keys of its one row (a bias broadcast along the queries; the tuple
    holds the row). Called right after S's wgmma is issued, so that the reads fly with it."""
    _, _, _, _, _, _, _, _, bias_rows = score
    if BIAS == 2:
        bias = _ring_bias_tile(bias_rows, stage, BLOCK_N, s_layout)
    elif BIAS == 1:
        bias = attn_bias_tile(bias_rows, start_n, seqlen_k, BLOCK_N, MASK, s_layout)
    elif BIAS == 4:
        # One row for every query: the block's keys of it, broadcast down the tile.
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if MASK:
            row = gl.load(bias_rows + keys, mask=keys < seqlen_k, other=0.0)
        else:
            row = gl.load(bias_rows + keys)
        bias = gl.expand_dims(row, 0)
    else:
        bias = 0
    return bias


@gluon.jit
def _scores_start(score, stage, qk_scale_log2, BLOCK_N: gl.constexpr, BIAS: gl.constexpr, s_layout: gl.constexpr):
    """S's accumulator start for the block in ring slot ``stage``: with BIAS 3 its attn_bias tile in raw score
    units (bias / softmax_scale, so that S = Q K^T comes out with the bias added: nothing of it stays live
    while the product runs, and the softmax is plain attention's), else zeros (the wgmma overwrites them)."""
    if BIAS == 3:
        _, _, _, _, _, _, _, _, bias_rows = score
        start = _ring_bias_tile(bias_rows, stage, BLOCK_N, s_layout).to(gl.float32) * (LOG2E / qk_scale_log2)
    else:
        start = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    return start


@gluon.jit
def _wait_block_operands(k_ready, v_ready, kv0, j, NUM_STAGES: gl.constexpr):
    """Ring slots of block j's K and block j - 1's V (kv0: the ring position of block 0), and their
    phase, once both have landed: (stage, phase, prev)."""
    stage = (kv0 + j) % NUM_STAGES
    phase = ((kv0 + j) // NUM_STAGES) & 1
    prev = (kv0 + j - 1) % NUM_STAGES
    prev_phase = ((kv0 + j - 1) // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    mbarrier.wait(v_ready.index(prev), prev_phase)
    return stage, phase, prev


@gluon.jit
def _pipelined_blocks(q_op, q_buf, k_smem, v_smem, ones_t, k_ready, k_empty, v_ready, v_empty, my_turn,
                      other_turn, acc, p_op, m_i, l_i, j_start, j_end, kv0, turn0, rows, seqlen_k, diag,
                      qk_scale_log2, score, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
                      CAUSAL: gl.constexpr, LOCAL: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                      REL_BIAS: gl.constexpr, BIAS: gl.constexpr,
                      PINGPONG: gl.constexpr, s_layout: gl.constexpr,
                      p_layout: gl.constexpr, SKIP_LAST_CHUNK: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """Blocks j in [j_start, j_end): issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} together (and
    l += P_{j-1} 1 with ROW_SUM_MMA), run the softmax of S_j while the PV wgmma is in flight.
    SKIP_LAST_CHUNK: see _scores_skipping_zero_chunk.
    kv0: the ring position of block 0 (K/V blocks consumed by earlier tiles of a persistent CTA);
    turn0: the ping-pong issue points of those tiles."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    V_DIM: gl.constexpr = v_smem.shape[4]
    for j in range(j_start, j_end):
        stage, phase, prev = _wait_block_operands(k_ready, v_ready, kv0, j, NUM_STAGES)
        k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute([1, 0])
        v_prev = v_smem.index(prev).reshape([BLOCK_N, V_DIM])
        s_start = _scores_start(score, stage, qk_scale_log2, BLOCK_N, BIAS, s_layout)
        if PINGPONG:
            # Issue point number j of this warpgroup in this tile (the prologue was number 0).
            mbarrier.wait(my_turn, (turn0 + j) & 1)
        if SKIP_LAST_CHUNK:
            s_tok = _scores_skipping_zero_chunk(q_buf, k_smem.index(stage), s_start)
        else:
            s_tok = warpgroup_mma(q_op, k_t, s_start, use_acc=BIAS == 3, is_async=True)
        o_tok = warpgroup_mma(p_op, v_prev, acc, is_async=True)
        if ROW_SUM_MMA:
            l_tok = warpgroup_mma(p_op, ones_t, l_i, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        bias = _block_bias(score, j * BLOCK_N, seqlen_k, stage, BLOCK_N, MASK, BIAS, s_layout)

        # wgmma groups retire in order: with the P V (and P 1) groups outstanding, S_j is done.
        if SKIP_LAST_CHUNK:
            s, _, _ = warpgroup_mma_wait(2 if ROW_SUM_MMA else 1, deps=[s_tok, q_buf, k_smem])
        else:
            s, _, _ = warpgroup_mma_wait(2 if ROW_SUM_MMA else 1, deps=[s_tok, q_op, k_t])
        mbarrier.arrive(k_empty.index(stage))
        p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, rows, j * BLOCK_N, seqlen_k, diag, qk_scale_log2, score,
                                            bias, BLOCK_N, MASK, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS,
                                            s_layout, ROW_SUM_MMA)
        if ROW_SUM_MMA:
            acc, l_i, _, _ = warpgroup_mma_wait(0, deps=[o_tok, l_tok, p_op, v_prev])
            l_i = l_i * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout)), 1)
        else:
            acc, _, _ = warpgroup_mma_wait(0, deps=[o_tok, p_op, v_prev])
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        p_op = _probabilities_operand(p, v_smem.dtype, p_layout)
    return acc, p_op, m_i, l_i


@gluon.jit
def _last_product(p_op, v_tile, ones_t, acc, l_i, my_turn, other_turn, turn_phase, PINGPONG: gl.constexpr,
                  ROW_SUM_MMA: gl.constexpr):
    """O += P V (and l += P 1) at this warpgroup's issue point with parity turn_phase, waited for."""
    if PINGPONG:
        mbarrier.wait(my_turn, turn_phase)
    o_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    if ROW_SUM_MMA:
        l_tok = warpgroup_mma(p_op, ones_t, l_i, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn)
    if ROW_SUM_MMA:
        acc, l_i, _, _ = warpgroup_mma_wait(0, deps=[o_tok, l_tok, p_op, v_tile])
    else:
        acc, _, _ = warpgroup_mma_wait(0, deps=[o_tok, p_op, v_tile])
    return acc, l_i


@gluon.jit
def _drain(p_op, v_smem, ones_t, v_ready, v_empty, q_empty, my_turn, other_turn, acc, l_i, n_total, kv0, turn0,
           CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
           PERSISTENT: gl.constexpr, ROW_SUM_MMA: gl.constexpr):
    """O += P_last V_last once every S of the tile has retired (a persistent CTA hands Q back first).
    (Issuing the next tile's S_0 together with this product did not pay: docs/experiments.md.)"""
    V_DIM: gl.constexpr = v_smem.shape[4]
    if PERSISTENT:
        mbarrier.arrive(q_empty.index(CONSUMER))
    last = kv0 + n_total - 1
    stage = last % NUM_STAGES
    mbarrier.wait(v_ready.index(stage), (last // NUM_STAGES) & 1)
    v_last = v_smem.index(stage).reshape([BLOCK_N, V_DIM])
    acc, l_i = _last_product(p_op, v_last, ones_t, acc, l_i, my_turn, other_turn, (turn0 + n_total) & 1, PINGPONG,
                             ROW_SUM_MMA)
    mbarrier.arrive(v_empty.index(stage))
    return acc, l_i


@gluon.jit
def _sees_half_of_last_block(my_start, seqlen_k, diag, n_total, BLOCK_N: gl.constexpr):
    """Whether the 64 rows from my_start see no key past the first half of the tile's last key block
    (the causal diagonal, or the ragged end, falls in its first half), with at least one block before it."""
    last_seen = gl.minimum(seqlen_k - 1, my_start + 63 + diag)
    return (n_total >= 2) & (last_seen < (n_total - 1) * BLOCK_N + BLOCK_N // 2)


@gluon.jit
def _own_key_range(my_start, seqlen_k, diag, n_unmasked, n_total, BLOCK_N: gl.constexpr):
    """(n_unmasked, n_total) of the 64 causal rows from my_start alone (OWN_KEY_RANGE), within the
    tile's: blocks past the last key its last row sees are not its work, and blocks wholly before its
    first row's diagonal need no mask."""
    visible_end = gl.minimum(gl.maximum(my_start + 64 + diag, 0), seqlen_k)
    n_mine = gl.minimum(gl.cdiv(visible_end, BLOCK_N), n_total)
    free = gl.minimum(gl.maximum(my_start + diag + 1, 0) // BLOCK_N, seqlen_k // BLOCK_N)
    return gl.minimum(gl.maximum(free, n_unmasked), n_mine), n_mine


@gluon.jit
def _release_blocks(k_ready, k_empty, v_ready, v_empty, kv0, j_start, j_end, NUM_STAGES: gl.constexpr):
    """Hands ring slots of blocks [j_start, j_end) back unread (blocks only later warpgroups see).
    Each arrival waits until the slot holds its block: an arrival for a block not yet loaded would
    count toward the slot's previous use and free it under a warpgroup still reading it."""
    for j in range(j_start, j_end):
        stage = (kv0 + j) % NUM_STAGES
        phase = ((kv0 + j) // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        mbarrier.arrive(k_empty.index(stage))
        mbarrier.wait(v_ready.index(stage), phase)
        mbarrier.arrive(v_empty.index(stage))


@gluon.jit
def _half_last_block(q_op, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty, q_empty, my_turn,
                     other_turn, acc, p_op, m_i, l_i, j, kv0, turn0, rows, seqlen_k, diag, qk_scale_log2, score,
                     CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, REL_BIAS: gl.constexpr, BIAS: gl.constexpr,
                     PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr, ROW_SUM_MMA: gl.constexpr,
                     p_layout: gl.constexpr):
    """The tile's last key block j (>= 1) for a warpgroup whose rows see only its first BLOCK_N / 2 keys
    (TRIM_DIAGONAL): S = Q K_j[:half]^T is issued with O += P_{j-1} V_{j-1}, then O += P_j V_j[:half].
    Same issue points and ring releases as a full-width block. Head dim 64 (one swizzle chunk per
    K, V row, so the first half of the keys is a whole 64-row view)."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    HALF: gl.constexpr = BLOCK_N // 2
    gl.static_assert((HEAD_DIM == 64) & (v_smem.shape[4] == 64), "TRIM_DIAGONAL: head dim 64 only")
    gl.static_assert(BIAS < 2, "TRIM_DIAGONAL: attn_bias's tiles are loaded, not read from the ring")
    dtype: gl.constexpr = k_smem.dtype
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    h_rows: gl.constexpr = gl.SliceLayout(1, h_layout)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    stage, phase, prev = _wait_block_operands(k_ready, v_ready, kv0, j, NUM_STAGES)
    k_half_t = reinterpret(k_smem.index(stage), dtype, [2, HALF, HEAD_DIM], tile_layout).index(0).permute([1, 0])
    v_prev = v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM])
    if PINGPONG:
        mbarrier.wait(my_turn, (turn0 + j) & 1)
    s_tok = warpgroup_mma(q_op, k_half_t, gl.zeros([64, HALF], gl.float32, h_layout), use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p_op, v_prev, acc, is_async=True)
    if ROW_SUM_MMA:
        ones_t = ones_smem.permute([1, 0])
        l_tok = warpgroup_mma(p_op, ones_t, l_i, is_async=True)
    if PINGPONG:
        mbarrier.arrive(other_turn)
    slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, row0, bias_rows = score
    if BIAS:
        bias_rows = gl.convert_layout(bias_rows, h_rows)
    half_score = (slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, row0,
                  bias_rows)
    bias = _block_bias(half_score, j * BLOCK_N, seqlen_k, stage, HALF, True, BIAS, h_layout)
    s, _, _ = warpgroup_mma_wait(2 if ROW_SUM_MMA else 1, deps=[s_tok, q_op, k_half_t])
    mbarrier.arrive(k_empty.index(stage))
    if PERSISTENT:
        mbarrier.arrive(q_empty.index(CONSUMER))  # every S of the tile has retired
    m_h = gl.convert_layout(m_i, h_rows)
    if ROW_SUM_MMA:
        l_h = l_i
    else:
        l_h = gl.convert_layout(l_i, h_rows)
    p, alpha, m_h, l_h = _softmax_block(s, m_h, l_h, gl.convert_layout(rows, h_rows), j * BLOCK_N, seqlen_k, diag,
                                        qk_scale_log2, half_score, bias, HALF, True, CAUSAL, False, SOFTCAP, ALIBI,
                                        REL_BIAS, BIAS, h_layout, ROW_SUM_MMA)
    if ROW_SUM_MMA:
        acc, l_i, _, _ = warpgroup_mma_wait(0, deps=[o_tok, l_tok, p_op, v_prev])
        l_i = l_i * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout)), 1)
    else:
        acc, _, _ = warpgroup_mma_wait(0, deps=[o_tok, p_op, v_prev])
        l_i = gl.convert_layout(l_h, m_i.type.layout)
    mbarrier.arrive(v_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    m_i = gl.convert_layout(m_h, m_i.type.layout)
    p_half = _probabilities_operand(p, dtype, p_layout)

    # O += P_j V_j[:half] (and l += P_j 1).
    mbarrier.wait(v_ready.index(stage), phase)
    v_half = reinterpret(v_smem.index(stage), dtype, [2, HALF, HEAD_DIM], tile_layout).index(0)
    ones_half_t = ones_smem  # unused without ROW_SUM_MMA
    if ROW_SUM_MMA:
        ones_half_t = reinterpret(ones_smem, dtype, [2, 8, HALF], tile_layout).index(0).permute([1, 0])
    acc, l_i = _last_product(p_half, v_half, ones_half_t, acc, l_i, my_turn, other_turn, (turn0 + j + 1) & 1,
                             PINGPONG, ROW_SUM_MMA)
    mbarrier.arrive(v_empty.index(stage))
    return acc, m_i, l_i


@gluon.jit
def _consume(q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready, v_empty,
             turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h, qk_scale_log2,
             start_m, head, batch, q_start, seqlen_q, seqlen_k, rows_end, n_first, n_free_lo, n_unmasked, n_total,
             kv0, turn0, q_phase, reverse, score, sink_ptr, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr,
             SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, REL_BIAS: gl.constexpr, BIAS: gl.constexpr,
             PINGPONG: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_SEQUSED_Q: gl.constexpr,
             HEAD_DIM_TRUE: gl.constexpr, PERSISTENT: gl.constexpr, ROW_SUM_MMA: gl.constexpr,
             TRIM_DIAGONAL: gl.constexpr, OWN_KEY_RANGE: gl.constexpr, HEAD_DIM_V_TRUE: gl.constexpr,
             QUERY_GROUP: gl.constexpr):
    """One 64-row slice of a tile: key blocks [n_first, n_total), of which [n_free_lo, n_unmasked) need
    no mask (n_first and n_free_lo are 0 but for a window). kv0 / turn0 / q_phase: the K/V ring
    position, ping-pong issue points and tiles (mod 2) of the tiles a persistent CTA ran before this
    one (0 otherwise). score: the options' runtime values (_softmax_block). sink_ptr: None, or (nheads,)
    learnable sink logits, taken into out and lse (sink.py).
    A persistent CTA hands Q back to the loader after the tile's last S and stages O in o_smem, so
    the next tile's Q lands during this tile's last P V and its output store. V (and O) may be narrower
    or wider than Q and K (head_dim_v != head_dim_qk: V_DIM, HEAD_DIM_V_TRUE); O is then staged in
    o_smem, not in the Q buffer."""
    # HEAD_DIM: the tiles' width (a power of two); HEAD_DIM_TRUE: the tensors' (<= HEAD_DIM). TMA
    # zero-fills the columns past HEAD_DIM_TRUE on loads and clips them on stores, so S is exact and
    # O's columns past it come out zero; only the register store below has to leave them alone.
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    V_DIM: gl.constexpr = v_smem.shape[4]
    O_APART: gl.constexpr = PERSISTENT or (V_DIM != HEAD_DIM)
    # Head dims 136..192 in 256-wide tiles: S skips the all-zero last 64 columns.
    SKIP_LAST_CHUNK: gl.constexpr = (HEAD_DIM == 256) & (HEAD_DIM_TRUE <= 192)
    gl.static_assert(not (SKIP_LAST_CHUNK and BIAS == 3), "S's start is zero where it skips a chunk")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, V_DIM, 16])
    # P feeds wgmma as a register A operand; with matching M tiling this layout is the S
    # accumulator layout, so the conversion moves no data.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # ROW_SUM_MMA: the tensor cores take P's row sums, l += P 1 with a (BLOCK_N, 8) block of ones
    # issued after O += P V and rescaled with it. l is then a (64, 8) wgmma accumulator whose
    # columns all hold the sums (else a (64,) vector). It saves the softmax 64 adds and 4 shuffles
    # per block and thread (the d64 loop is bound by issue slots), and sums the bf16 / fp16 P that
    # P V multiplies: O's numerator and denominator round alike, and lse carries P's rounding
    # (at most 2^-8 relative in l for bf16, 2^-11 for fp16: 4e-3 / 5e-4 in lse).
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 8, 16])
    if ROW_SUM_MMA:
        ones_t = ones_smem.permute([1, 0])
    else:
        ones_t = ones_smem

    my_start = _chunk_start(start_m, CONSUMER, reverse, BLOCK_M // 64)
    rows = my_start + gl.arange(0, 64, layout=row_layout)
    # The relative bias reads its blocks' distance from the diagonal off the slice's first row; attn_bias
    # its rows' pointers (from the (batch, head)'s first element, with the bias's query stride).
    slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, bias_head = score
    bias_head, stride_bias_m, bias_smem = bias_head
    bias_rows = 0
    if BIAS == 2 or BIAS == 3:
        bias_rows = (bias_smem, CONSUMER * NUM_STAGES)
    elif BIAS == 4:
        bias_rows = bias_head
    elif BIAS:
        bias_rows = attn_bias_rows(bias_head, rows, seqlen_q, stride_bias_m)
    score = (slope_log2, softcap_scale, softcap_log2, window_left, window_right, rel_row, rel_distance, my_start,
             bias_rows)
    # The masks see query positions. With a GQA group's query heads packed as rows (QUERY_GROUP > 1:
    # the host's layout, row r of a kv head is query head r % QUERY_GROUP at position r // QUERY_GROUP),
    # the tile's rows hold seqlen_q // QUERY_GROUP positions; the options that read a query head's
    # tensors (ALiBi slopes, sinks, tables, biases) and the causal schedules by rows are off.
    if QUERY_GROUP > 1:
        gl.static_assert(not (ALIBI or REL_BIAS or BIAS or OWN_KEY_RANGE or TRIM_DIAGONAL or HAS_SEQUSED_Q),
                         "packed GQA rows: no per-head options, no row schedules")
        gl.static_assert(sink_ptr is None, "packed GQA rows: no learnable sink")
        positions = rows // QUERY_GROUP
        diag = seqlen_k - seqlen_q // QUERY_GROUP
    else:
        positions = rows
        diag = seqlen_k - seqlen_q

    # Ping-pong: consumer warpgroups take turns (round robin) issuing their wgmmas, so one's
    # softmax runs while another's GEMMs own the tensor cores.
    my_turn = turn.index(CONSUMER)
    other_turn = turn.index((CONSUMER + 1) % (BLOCK_M // 64))
    q_buf = q_smem.index(CONSUMER)
    q_op = q_buf.reshape([64, HEAD_DIM])
    mbarrier.wait(q_ready.index(CONSUMER), q_phase)

    # The tile's key blocks [0, n_total) are loaded; this warpgroup multiplies [0, n_mine).
    n_mine = n_total
    if OWN_KEY_RANGE:
        n_unmasked, n_mine = _own_key_range(my_start, seqlen_k, diag, n_unmasked, n_total, BLOCK_N)

    m_i = gl.full([64], float("-inf"), gl.float32, row_layout)
    if ROW_SUM_MMA:
        l_i = gl.zeros([64, 8], gl.float32, l_layout)
    else:
        l_i = gl.zeros([64], gl.float32, row_layout)
    acc = gl.zeros([64, V_DIM], gl.float32, o_layout)

    if LOCAL:
        # A window's first block n_first is the ring's (and the issue points') number 0: shifting
        # both counts lets every loop below index blocks by their key position.
        kv0 = kv0 - n_first
        turn0 = turn0 - n_first
    if n_mine > n_first:
        # Block n_first alone: S, softmax, nothing to overlap yet.
        stage0 = (kv0 + n_first) % NUM_STAGES
        mbarrier.wait(k_ready.index(stage0), ((kv0 + n_first) // NUM_STAGES) & 1)
        k_t = k_smem.index(stage0).reshape([BLOCK_N, HEAD_DIM]).permute([1, 0])
        s_start = _scores_start(score, stage0, qk_scale_log2, BLOCK_N, BIAS, s_layout)
        if PINGPONG:
            mbarrier.wait(my_turn, (turn0 + n_first) & 1)
        if SKIP_LAST_CHUNK:
            s_tok = _scores_skipping_zero_chunk(q_buf, k_smem.index(stage0), s_start)
        else:
            s_tok = warpgroup_mma(q_op, k_t, s_start, use_acc=BIAS == 3, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        bias = _block_bias(score, n_first * BLOCK_N, seqlen_k, stage0, BLOCK_N, True, BIAS, s_layout)
        if SKIP_LAST_CHUNK:
            s, _, _ = warpgroup_mma_wait(0, deps=[s_tok, q_buf, k_smem])
        else:
            s, _, _ = warpgroup_mma_wait(0, deps=[s_tok, q_op, k_t])
        mbarrier.arrive(k_empty.index(stage0))
        # Masked only when it has to be (block 0 holds the causal diagonal, or the keys end inside
        # it): the mask adds two fifths to the d64 softmax's instructions, and a causal tile at 1k
        # keys has only 4.5 blocks on average. No wgmma is in flight here, so the branch cannot
        # split an async group.
        if (n_free_lo <= n_first) & (n_first < n_unmasked):
            p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, positions, n_first * BLOCK_N, seqlen_k, diag,
                                                qk_scale_log2, score, bias, BLOCK_N, False, CAUSAL, LOCAL, SOFTCAP,
                                                ALIBI, REL_BIAS, BIAS, s_layout, ROW_SUM_MMA)
        else:
            p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, positions, n_first * BLOCK_N, seqlen_k, diag,
                                                qk_scale_log2, score, bias, BLOCK_N, True, CAUSAL, LOCAL, SOFTCAP,
                                                ALIBI, REL_BIAS, BIAS, s_layout, ROW_SUM_MMA)
        p_op = _probabilities_operand(p, v_smem.dtype, p_layout)

        # Mask-free blocks, then the blocks on the diagonal / ragged end (but a last block this
        # warpgroup sees only the first half of, with TRIM_DIAGONAL).
        n_wide = n_mine
        if TRIM_DIAGONAL:
            half_last = _sees_half_of_last_block(my_start, seqlen_k, diag, n_total, BLOCK_N)
            n_wide = n_total - half_last.to(gl.int32)
        free_start = n_first + 1
        if LOCAL:
            # Blocks cut by the window's left edge come first.
            free_start = gl.minimum(gl.maximum(n_free_lo, n_first + 1), n_wide)
            acc, p_op, m_i, l_i = _pipelined_blocks(
                q_op, q_buf, k_smem, v_smem, ones_t, k_ready, k_empty, v_ready, v_empty, my_turn, other_turn, acc,
                p_op, m_i, l_i, n_first + 1, free_start, kv0, turn0, positions, seqlen_k, diag, qk_scale_log2, score,
                BLOCK_N, NUM_STAGES, True, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, s_layout, p_layout,
                SKIP_LAST_CHUNK, ROW_SUM_MMA)
            split = gl.minimum(gl.maximum(n_unmasked, free_start), gl.maximum(n_wide, free_start))
        else:
            split = gl.maximum(n_unmasked, 1)
        acc, p_op, m_i, l_i = _pipelined_blocks(
            q_op, q_buf, k_smem, v_smem, ones_t, k_ready, k_empty, v_ready, v_empty, my_turn, other_turn, acc, p_op,
            m_i, l_i, free_start, split, kv0, turn0, positions, seqlen_k, diag, qk_scale_log2, score,
            BLOCK_N, NUM_STAGES, False, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, s_layout, p_layout,
            SKIP_LAST_CHUNK, ROW_SUM_MMA)
        acc, p_op, m_i, l_i = _pipelined_blocks(
            q_op, q_buf, k_smem, v_smem, ones_t, k_ready, k_empty, v_ready, v_empty, my_turn, other_turn, acc, p_op,
            m_i, l_i, split, n_wide, kv0, turn0, positions, seqlen_k, diag, qk_scale_log2, score,
            BLOCK_N, NUM_STAGES, True, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, s_layout, p_layout,
            SKIP_LAST_CHUNK, ROW_SUM_MMA)

        if TRIM_DIAGONAL:
            if n_wide < n_total:
                acc, m_i, l_i = _half_last_block(
                    q_op, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty, q_empty, my_turn,
                    other_turn, acc, p_op, m_i, l_i, n_wide, kv0, turn0, positions, seqlen_k, diag, qk_scale_log2,
                    score, CONSUMER, BLOCK_N, NUM_STAGES, CAUSAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, PERSISTENT,
                    ROW_SUM_MMA, p_layout)
            else:
                acc, l_i = _drain(p_op, v_smem, ones_t, v_ready, v_empty, q_empty, my_turn, other_turn, acc, l_i,
                                  n_total, kv0, turn0, CONSUMER, BLOCK_N, NUM_STAGES, PINGPONG, PERSISTENT,
                                  ROW_SUM_MMA)
        else:
            acc, l_i = _drain(p_op, v_smem, ones_t, v_ready, v_empty, q_empty, my_turn, other_turn, acc, l_i,
                              n_mine, kv0, turn0, CONSUMER, BLOCK_N, NUM_STAGES, PINGPONG, PERSISTENT, ROW_SUM_MMA)
    elif PERSISTENT:
        mbarrier.arrive(q_empty.index(CONSUMER))
    if OWN_KEY_RANGE:
        _release_blocks(k_ready, k_empty, v_ready, v_empty, kv0, n_mine, n_total, NUM_STAGES)
    if ROW_SUM_MMA:
        l_i = gl.convert_layout(gl.max(l_i, axis=1), row_layout)

    empty_lse = float("-inf")
    if sink_ptr is not None:
        sink_log2 = load_sink_log2(sink_ptr, head)
        sink_alpha, m_i, l_i = fold_sink(m_i, l_i, sink_log2)
        empty_lse = sink_log2 * LN2
    # A row that saw no key (l = 0) outputs zeros and lse = -inf (the sink's logit, with one: l = 1).
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    if HAS_SEQUSED_Q:
        # Rows past the used ones count as rows that saw no key. Their queries may be garbage,
        # hence a select rather than a scale by 0.
        lse = gl.where(rows >= seqlen_q, empty_lse, lse)
    if sink_ptr is not None:
        inv_l = gl.convert_layout(sink_alpha / l_safe, gl.SliceLayout(1, o_layout))
    else:
        inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
    out = acc * gl.expand_dims(inv_l, 1)
    if HAS_SEQUSED_Q:
        unused = gl.convert_layout(rows >= seqlen_q, gl.SliceLayout(1, o_layout))
        out = gl.where(gl.expand_dims(unused, 1), 0.0, out)
    out = out.to(q_smem.dtype)

    if IS_VARLEN:
        # lse is (h, total_q): the sequence's rows start at column q_start (packed GQA rows: position q_start // g).
        positions, heads = _position_and_head(q_start + rows, head, QUERY_GROUP)
        lse_ptrs = lse_ptr + heads.to(gl.int64) * stride_lse_h + positions
        gl.store(lse_ptrs, lse, mask=rows < rows_end)
        if my_start + 64 <= rows_end:
            # The whole box lies in this sequence: TMA store through the dead Q buffer (or O's own).
            if O_APART:
                o_buf = o_smem.index(CONSUMER)
                o_buf.reshape([64, V_DIM]).store(out)
                fence_async_shared()
                _store_rows(o_desc, 0, q_start + my_start, head, o_buf, QUERY_GROUP)
            else:
                q_op.store(out)
                fence_async_shared()
                _store_rows(o_desc, 0, q_start + my_start, head, q_buf, QUERY_GROUP)
            tma.store_wait(0)
        else:
            # The sequence's last (ragged) rows: a TMA box would overwrite the next sequence's
            # rows, so store from registers with a row mask.
            o_rows = my_start + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
            o_cols = gl.arange(0, V_DIM, layout=gl.SliceLayout(0, o_layout))
            # out has a TMA descriptor, so 16-byte strides: multiples of 8 elements. Spelled out
            # (x // 8 * 8) so the compiler can vectorize the stores.
            o_positions, o_heads = _position_and_head(q_start + o_rows, head, QUERY_GROUP)
            row_off = o_positions.to(gl.int64) * (stride_o_s // 8 * 8) + o_heads.to(gl.int64) * (stride_o_h // 8 * 8)
            o_ptrs = o_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(o_cols, 0)
            keep = gl.expand_dims(o_rows < rows_end, 1)
            if HEAD_DIM_V_TRUE < V_DIM:
                # Padded tiles: the columns past the head dim are the next head's.
                keep = keep & gl.expand_dims(o_cols < HEAD_DIM_V_TRUE, 0)
            gl.store(o_ptrs, out, mask=keep)
    else:
        positions, heads = _position_and_head(rows, head, QUERY_GROUP)
        lse_ptrs = lse_ptr + batch.to(gl.int64) * stride_lse_b + heads.to(gl.int64) * stride_lse_h + positions
        gl.store(lse_ptrs, lse, mask=rows < seqlen_q)

        if PERSISTENT:
            # The previous tile's store must have read the staging buffer; this one's completes
            # under the next tile (the kernel waits for it before exiting).
            o_buf = o_smem.index(CONSUMER)
            tma.store_wait(0)
            o_buf.reshape([64, V_DIM]).store(out)
            fence_async_shared()
            _store_rows(o_desc, batch, my_start, head, o_buf, QUERY_GROUP)
        elif O_APART:
            o_buf = o_smem.index(CONSUMER)
            o_buf.reshape([64, V_DIM]).store(out)
            fence_async_shared()
            _store_rows(o_desc, batch, my_start, head, o_buf, QUERY_GROUP)
            tma.store_wait(0)
        else:
            # Q is dead (last wgmma retired): reuse its buffer to stage O for a TMA store, which
            # clips rows past seqlen_q.
            q_op.store(out)
            fence_async_shared()
            _store_rows(o_desc, batch, my_start, head, q_buf, QUERY_GROUP)
            tma.store_wait(0)


@gluon.jit
def _position_and_head(rows, head, QUERY_GROUP: gl.constexpr):
    """(position, query head) of the tile rows ``rows`` of head ``head``: with packed GQA rows (QUERY_GROUP = g
    > 1) row r of kv head ``head`` is query head head * g + r % g at position r // g; else the rows are the
    positions, all of the one head."""
    if QUERY_GROUP > 1:
        return rows // QUERY_GROUP, head * QUERY_GROUP + rows % QUERY_GROUP
    else:
        return rows, head


@gluon.jit
def _store_rows(o_desc, batch, row, head, buf, QUERY_GROUP: gl.constexpr):
    """TMA store of the 64 output rows staged in ``buf`` from ``row`` of (batch, head); packed GQA rows
    (QUERY_GROUP > 1) as the (1, 64 / g, 1, g, d) box of out as (b, s, hk, g, d)."""
    if QUERY_GROUP > 1:
        tma_store(o_desc, [batch, row // QUERY_GROUP, head, 0, 0], buf)
    else:
        tma_store(o_desc, [batch, row, head, 0], buf)


@gluon.jit
def _bias_source(attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, batch, head, BIAS: gl.constexpr):
    """The score tuple's attn_bias entry (_consume): the (batch, head)'s first element and the query stride
    that BIAS 1 loads from, and the tile ring that BIAS 2 reads (else 0)."""
    ring = 0
    if BIAS == 2 or BIAS == 3:
        ring = bias_smem
    loads: gl.constexpr = BIAS == 1 or BIAS == 4
    return attn_bias_head(attn_bias, stride_bias_b, stride_bias_h, batch, head, loads), stride_bias_m, ring


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready, v_empty,
              turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h, cu_seqlens_q,
              cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group, n_batch, heads_per_group,
              qk_scale_log2, window_left, window_right, softcap_scale, softcap_log2, alibi_slopes, stride_alibi_b,
              sink_ptr, rel_bias_table, rel_bias_distance, attn_bias, stride_bias_b, stride_bias_h, stride_bias_m,
              bias_smem, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, LOCAL: gl.constexpr, SOFTCAP: gl.constexpr,
              ALIBI: gl.constexpr, REL_BIAS: gl.constexpr, BIAS: gl.constexpr, PINGPONG: gl.constexpr,
              IS_VARLEN: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr, PERSISTENT: gl.constexpr,
              ROW_SUM_MMA: gl.constexpr, TRIM_DIAGONAL: gl.constexpr, OWN_KEY_RANGE: gl.constexpr,
              HEAD_DIM_V_TRUE: gl.constexpr, QUERY_GROUP: gl.constexpr, block_table=None, key_shift=None,
              table_keys=0):
    # block_table, key_shift, table_keys: K and V through a table of pages (forward_tile: the keys it uses).
    if PERSISTENT:
        kv0 = 0
        turn0 = 0
        tile_iter = 0
        for u in range(gl.program_id(0), _dense_units(seqlen_q, nheads, n_batch, BLOCK_M, CAUSAL),
                       gl.num_programs(0)):
            for half in range(_unit_tiles(u, seqlen_q, BLOCK_M, CAUSAL)):
                start_m, head, kv_head, batch = _dense_tile(u, half, seqlen_q, nheads, head_group, BLOCK_M, CAUSAL)
                n_first, n_free_lo, n_unmasked, n_total = key_blocks(start_m, seqlen_q, seqlen_k, window_left,
                                                                     window_right, BLOCK_M, BLOCK_N, CAUSAL, LOCAL,
                                                                     False, QUERY_GROUP)
                reverse = False
                if OWN_KEY_RANGE:
                    reverse = half == 1
                score = (alibi_slope_log2(alibi_slopes, stride_alibi_b, batch, head, ALIBI), softcap_scale,
                         softcap_log2, window_left, window_right,
                         relative_bias_row(rel_bias_table, head, rel_bias_distance, REL_BIAS), rel_bias_distance,
                         _bias_source(attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, batch, head,
                                      BIAS))
                _consume(q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         qk_scale_log2, start_m, head, batch, 0, seqlen_q, seqlen_k, seqlen_q, n_first, n_free_lo,
                         n_unmasked, n_total, kv0, turn0, tile_iter & 1, reverse, score, sink_ptr, CONSUMER, BLOCK_M,
                         BLOCK_N, NUM_STAGES, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, False, False,
                         HEAD_DIM_TRUE,
                         True, ROW_SUM_MMA, TRIM_DIAGONAL, OWN_KEY_RANGE, HEAD_DIM_V_TRUE, QUERY_GROUP)
                n_blocks = n_total - n_first
                kv0 += n_blocks
                # A tile with key blocks has n_blocks + 1 issue points (its first S, then S_j with
                # P_{j-1} V_{j-1}, then the last P V).
                turn0 += gl.where(n_blocks > 0, n_blocks + 1, 0)
                tile_iter += 1
        tma.store_wait(0)
    else:
        start_m, head, kv_head, batch, q_start, k_start, seqlen_q, seqlen_k, rows_end, valid = forward_tile(
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, head_group, heads_per_group,
            BLOCK_M, CAUSAL, IS_VARLEN, QUERY_GROUP, block_table, key_shift, table_keys)
        n_first, n_free_lo, n_unmasked, n_total = key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                             BLOCK_M, BLOCK_N, CAUSAL, LOCAL, seqused_q is not None,
                                                             QUERY_GROUP)
        score = (alibi_slope_log2(alibi_slopes, stride_alibi_b, batch, head, ALIBI), softcap_scale, softcap_log2,
                 window_left, window_right, relative_bias_row(rel_bias_table, head, rel_bias_distance, REL_BIAS),
                 rel_bias_distance,
                 _bias_source(attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, batch, head, BIAS))
        if IS_VARLEN:
            if valid:
                _consume(q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         qk_scale_log2, start_m, head, batch, q_start, seqlen_q, seqlen_k, rows_end, n_first,
                         n_free_lo, n_unmasked, n_total, 0, 0, 0, False, score, sink_ptr, CONSUMER, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL, LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN,
                         seqused_q is not None,
                         HEAD_DIM_TRUE, False, ROW_SUM_MMA, TRIM_DIAGONAL, OWN_KEY_RANGE, HEAD_DIM_V_TRUE,
                         QUERY_GROUP)
        else:
            _consume(q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready, v_empty,
                     turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h, qk_scale_log2,
                     start_m, head, batch, q_start, seqlen_q, seqlen_k, rows_end, n_first, n_free_lo, n_unmasked,
                     n_total, 0, 0, 0, False, score, sink_ptr, CONSUMER, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, LOCAL,
                     SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, False, HEAD_DIM_TRUE, False, ROW_SUM_MMA,
                     TRIM_DIAGONAL,
                     OWN_KEY_RANGE, HEAD_DIM_V_TRUE, QUERY_GROUP)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

# Sizes and strides stay runtime values: specializing them (== 1, % 16) would only multiply
# compilations. Varlen (IS_VARLEN): cu_seqlens_q / cu_seqlens_k (batch + 1,) int32 prefix sums,
# seqused_q / seqused_k (batch,) int32 or None, o_ptr / stride_o_s / stride_o_h address out for the
# ragged-tile store; dense passes None for all of them (compile-time constants, no code).
# PERSISTENT (dense only): a grid of about one CTA per SM, each looping over the work units
# u = program_id, program_id + num_programs, ... (see _dense_units); otherwise one CTA per
# (query block, head, batch) of the grid.
@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "seqlen_q", "seqlen_k", "nheads", "head_group",
                              "n_batch", "heads_per_group", "stride_o_s", "stride_o_h", "window_left", "window_right",
                              "stride_alibi_b", "rel_bias_distance", "stride_table", "page_size", "table_keys"])
def gluon_attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, stride_lse_b, stride_lse_h,
                          seqlen_q, seqlen_k, nheads, head_group, n_batch, heads_per_group, qk_scale_log2,
                          cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, o_ptr, stride_o_s, stride_o_h,
                          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                          PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
                          IS_VARLEN: gl.constexpr, HEAD_DIM_TRUE: gl.constexpr, PERSISTENT: gl.constexpr,
                          ROW_SUM_MMA: gl.constexpr, TRIM_DIAGONAL: gl.constexpr = False,
                          OWN_KEY_RANGE: gl.constexpr = False, LOCAL: gl.constexpr = False,
                          SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, window_left=0, window_right=0,
                          softcap_scale=0.0, softcap_log2=0.0, alibi_slopes=None, stride_alibi_b=0,
                          HEAD_DIM_V_TRUE: gl.constexpr = None, sink_ptr=None, rel_bias_table=None,
                          rel_bias_distance=0, attn_bias=None, stride_bias_b=0, stride_bias_h=0, stride_bias_m=0,
                          bias_desc=None, bias_batches=1, bias_heads=1, BIAS_ROW: gl.constexpr = False,
                          QUERY_GROUP: gl.constexpr = 1, block_table=None, stride_table=0, page_size=1,
                          table_keys=0, key_shift=None):
    # block_table: K and V are a kv cache's pages (num_pages, page_size, hk, d), read through this int32 table
    # (rows stride_table apart; a row addresses table_keys keys); page_size a multiple of BLOCK_N, or the
    # table one page per sequence. key_shift (int32 (batch,) or None): each sequence's first key there.
    # rel_bias_table: a relative-position bias table (nheads, 2 * rel_bias_distance + 1), float32
    # (flashtile.mods.relative_bias, scores.relative_bias_log2), or None. attn_bias: a bias added to
    # the scores, read with these batch / head / query strides (0 along broadcast dimensions) and unit key
    # stride (scores.attn_bias_tile), or None. bias_desc: instead of attn_bias, a descriptor of its (batch,
    # head, query, key) view (bias_batches, bias_heads: its batch and head dims, 1 where it broadcasts),
    # whose (64 rows x key block) tiles come through the K ring. BIAS_ROW: attn_bias has one row (it
    # broadcasts along the queries).
    REL_BIAS: gl.constexpr = rel_bias_table is not None
    # 0: no bias; 1: the consumers load its tiles and the softmax adds them; through the ring, 2: the
    # softmax adds it (after softcap), 3: it starts S's accumulator (_scores_start); 4: the consumers load
    # the keys of its one row and the softmax adds them.
    BIAS: gl.constexpr = (3 - SOFTCAP) * (bias_desc is not None) + (attn_bias is not None) * (1 + 3 * BIAS_ROW)
    # V's (and O's) head dim when it differs from Q's and K's (v_desc's and o_desc's boxes are its padded
    # width); None: the same.
    V_TRUE: gl.constexpr = HEAD_DIM_TRUE if HEAD_DIM_V_TRUE is None else HEAD_DIM_V_TRUE
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * 64
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    if ROW_SUM_MMA:
        # The B operand of the row-sum wgmma (l += P 1), K-major like K's tiles.
        ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], dtype)
        fill_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
        ones_smem = gl.allocate_shared_memory(dtype, [8, BLOCK_N], ones_layout,
                                              gl.full([8, BLOCK_N], 1.0, dtype, fill_layout))
    else:
        ones_smem = q_smem  # unused (warp_specialize's arguments cannot be None)

    if bias_desc is not None:
        # Consumer c's tile of ring slot i is tile c * NUM_STAGES + i.
        bias_smem = gl.allocate_shared_memory(bias_desc.dtype,
                                              [NUM_CONSUMERS * NUM_STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:
        bias_smem: gl.constexpr = None

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], bar_layout)
    if PERSISTENT:
        # O is staged apart from Q (the next tile's Q lands while this tile's O is stored), and each
        # consumer hands its Q buffer back through q_empty.
        o_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], bar_layout)
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(q_empty.index(c), count=1)
    else:
        if v_desc.block_type.shape[3] != q_desc.block_type.shape[-1]:
            # O's tile is not Q's shape: staged in its own buffer.
            o_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
        else:
            o_smem = q_smem
        q_empty = q_ready
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    # With seqused_k or pages, slots past a sequence's keys may hold anything: the loader zeroes V there.
    ZERO_V_TAIL: gl.constexpr = (seqused_k is not None) | (block_table is not None)
    if ZERO_V_TAIL:
        v_fix = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(v_fix, count=1)
    else:
        v_fix = v_ready  # unused (warp_specialize's arguments cannot be None)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # Every consumer warpgroup releases each slot once.
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    if PINGPONG:
        mbarrier.arrive(turn.index(0))  # consumer 0 issues first

    # Argument tuples are written inline: a tuple bound to a variable would turn the constexprs (and
    # the None arguments) into runtime values. Each consumer gets its index as a literal (a constexpr).
    if NUM_CONSUMERS == 1:
        # The consumer is the default partition: it gets the registers the loader's warpgroup leaves.
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 0, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, v_fix, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads,
                       head_group, n_batch, heads_per_group, window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES,
                       NUM_CONSUMERS, CAUSAL, LOCAL, IS_VARLEN, PERSISTENT, OWN_KEY_RANGE, QUERY_GROUP, bias_desc,
                       bias_smem, bias_batches, bias_heads, block_table, stride_table, page_size, table_keys,
                       key_shift)),
        ], [1], [LOADER_REGS])
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 0, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 1, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, v_fix, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads,
                       head_group, n_batch, heads_per_group, window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES,
                       NUM_CONSUMERS, CAUSAL, LOCAL, IS_VARLEN, PERSISTENT, OWN_KEY_RANGE, QUERY_GROUP, bias_desc,
                       bias_smem, bias_batches, bias_heads, block_table, stride_table, page_size, table_keys,
                       key_shift)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    elif NUM_CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 0, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 1, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 2, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, v_fix, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads,
                       head_group, n_batch, heads_per_group, window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES,
                       NUM_CONSUMERS, CAUSAL, LOCAL, IS_VARLEN, PERSISTENT, OWN_KEY_RANGE, QUERY_GROUP, bias_desc,
                       bias_smem, bias_batches, bias_heads, block_table, stride_table, page_size, table_keys,
                       key_shift)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.static_assert(NUM_CONSUMERS == 4, "1 to 4 consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 0, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 1, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 2, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_consumer, (q_smem, k_smem, v_smem, ones_smem, q_ready, q_empty, o_smem, k_ready, k_empty, v_ready,
                         v_empty, turn, o_desc, lse_ptr, stride_lse_b, stride_lse_h, o_ptr, stride_o_s, stride_o_h,
                         cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads, head_group,
                         n_batch, heads_per_group, qk_scale_log2, window_left, window_right, softcap_scale,
                         softcap_log2, alibi_slopes, stride_alibi_b, sink_ptr, rel_bias_table, rel_bias_distance,
                         attn_bias, stride_bias_b, stride_bias_h, stride_bias_m, bias_smem, 3, BLOCK_M, BLOCK_N,
                         NUM_STAGES, CAUSAL,
                         LOCAL, SOFTCAP, ALIBI, REL_BIAS, BIAS, PINGPONG, IS_VARLEN, HEAD_DIM_TRUE, PERSISTENT,
                         ROW_SUM_MMA,
                         TRIM_DIAGONAL, OWN_KEY_RANGE, V_TRUE, QUERY_GROUP, block_table, key_shift, table_keys)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                       v_empty, v_fix, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, nheads,
                       head_group, n_batch, heads_per_group, window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES,
                       NUM_CONSUMERS, CAUSAL, LOCAL, IS_VARLEN, PERSISTENT, OWN_KEY_RANGE, QUERY_GROUP, bias_desc,
                       bias_smem, bias_batches, bias_heads, block_table, stride_table, page_size, table_keys,
                       key_shift)),
        ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
