"""Which tiles of the score matrix a kernel visits, and which of them need element-wise masking.

Mask semantics (bottom-right aligned, see `cute_flash.spec`): with off = seqlen_k - seqlen_q, query row i sees key j
iff  i + off - left <= j <= i + off + right  and  0 <= j < seqlen_k.  "causal" is right = 0 with left unbounded,
"local" takes runtime `left`/`right` (either may be `UNBOUNDED_WINDOW`), "none" sees every key.

The score matrix is cut into tiles of `tile_m` query rows by `tile_n` key rows. Forward kernels walk the KV blocks of
one query block (`kv_block_range`); backward kernels walk the query blocks of one KV block (`q_block_range`). Inside
a range, only blocks crossing a window edge or the seqlen_k tail need element-wise masking; the helpers below give
those boundaries so kernels can run the interior blocks without any mask arithmetic.

Everything here is plain integer arithmetic written so that it works on Python ints (host code, CPU tests that check
it against brute force) and on CuTe DSL `Int32` values inside kernels. Divisions only ever see non-negative
numerators, so Python's floor division and the DSL's truncating division agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

Int = Any  # a Python int or a cutlass.Int32


def _is_py_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def int_min(a: Int, b: Int) -> Int:
    if _is_py_int(a) and _is_py_int(b):
        return a if a < b else b
    import cutlass

    return cutlass.min(a, b)


def int_max(a: Int, b: Int) -> Int:
    if _is_py_int(a) and _is_py_int(b):
        return a if a > b else b
    import cutlass

    return cutlass.max(a, b)


def _select(cond, a: Int, b: Int) -> Int:
    """a where cond else b, for Python bools and DSL booleans alike."""
    if isinstance(cond, bool):
        return a if cond else b
    import cutlass

    return cutlass.Int32(cutlass.select_(cond, a, b))


def _ceil_div_nonneg(x: Int, d: int) -> Int:
    """ceil(x / d) for x >= 0 (callers clamp first)."""
    return (x + (d - 1)) // d


@dataclass(frozen=True)
class BlockInfo:
    """Tile arithmetic for one (batch, head) attention problem.

    tile_m, tile_n and mask are compile-time constants; seqlen_q, seqlen_k and the window bounds may be runtime Int32.
    `window_left` / `window_right` are only read for mask == "local" (causal fixes right = 0, left unbounded).

    rows_per_query (forward direction only): the tile's rows are (query, head) pairs of the query heads that share a
    KV head (GQA packed into the rows, the KV-cache forward): row r holds query r // rows_per_query, so a tile of
    tile_m rows spans queries m_block * tile_m // rows_per_query .. and the sequence has seqlen_q * rows_per_query
    rows. None (every other kernel): row r is query r.
    """

    tile_m: int
    tile_n: int
    mask: str  # "none" | "causal" | "local"
    seqlen_q: Int
    seqlen_k: Int
    window_left: Int = 0
    window_right: Int = 0
    rows_per_query: Optional[Int] = None

    def __post_init__(self):
        if self.mask not in ("none", "causal", "local"):
            raise ValueError(f"unknown mask kind {self.mask!r}")

    @property
    def has_right_bound(self) -> bool:
        return self.mask in ("causal", "local")

    @property
    def has_left_bound(self) -> bool:
        return self.mask == "local"

    @property
    def offset(self) -> Int:
        """Key index aligned with query row 0 (bottom-right alignment)."""
        return self.seqlen_k - self.seqlen_q

    @property
    def right(self) -> Int:
        return 0 if self.mask == "causal" else self.window_right

    @property
    def left(self) -> Int:
        return self.window_left

    def first_query(self, m_block: Int) -> Int:
        """The query of m_block's first row."""
        if self.rows_per_query is None:
            return m_block * self.tile_m
        return (m_block * self.tile_m) // self.rows_per_query

    def last_query(self, m_block: Int) -> Int:
        """The query of m_block's last row inside the sequence (-1 for a sequence without queries; 0 with
        rows_per_query, whose tile then has no rows)."""
        if self.rows_per_query is None:
            return int_min((m_block + 1) * self.tile_m, self.seqlen_q) - 1
        rows = int_max(int_min((m_block + 1) * self.tile_m, self.seqlen_q * self.rows_per_query), 1)
        return (rows - 1) // self.rows_per_query

    # ----------------------------------------------------------------------------------------------------------------
    # Forward direction: KV blocks of one query block.
    # ----------------------------------------------------------------------------------------------------------------
    def kv_block_range(self, m_block: Int) -> Tuple[Int, Int]:
        """[n_block_min, n_block_max) of the KV blocks that hold at least one key some row of `m_block` sees.

        Empty (n_block_max <= n_block_min) when every row of the block sees no key; the kernel then writes 0 / -inf.
        Rows past seqlen_q do not widen the range.
        """
        n_block_max = _ceil_div_nonneg(self.seqlen_k, self.tile_n)
        if self.has_right_bound:
            last_row = self.last_query(m_block)
            key_end = last_row + self.offset + self.right + 1  # exclusive
            key_end = int_max(int_min(key_end, self.seqlen_k), 0)
            n_block_max = _ceil_div_nonneg(key_end, self.tile_n)
        n_block_min = 0
        if self.has_left_bound:
            key_start = int_max(self.first_query(m_block) + self.offset - self.left, 0)
            n_block_min = key_start // self.tile_n
            # The rows' windows [i + off - left, i + off + right] move by one key per row, so the keys they see
            # form the one interval [key_start, key_end) unless it is empty, or every window is (left + right < 0;
            # compared as left < -right, which cannot overflow).
            n_block_max = _select(self._no_keys(key_start, key_end), n_block_min, n_block_max)
        return n_block_min, n_block_max

    def _no_keys(self, start: Int, end: Int):
        """Whether a local window sees nothing of [start, end): an empty interval, or left + right < 0."""
        return (end <= start) | (self.left < -self.right)

    def kv_right_masked_start(self, m_block: Int) -> Int:
        """KV blocks n >= this may hold keys right of some row's window (or past seqlen_k): they need masking.

        Blocks below it are free of the right edge. Only meaningful when `has_right_bound`; the seqlen_k tail is
        always the last block of the range, which kernels mask anyway.
        """
        first_row = self.first_query(m_block)
        # Block n is clear of the right edge iff its last key (n+1)*tile_n - 1 <= first_row + off + right.
        return int_max(first_row + self.offset + self.right + 1, 0) // self.tile_n

    def kv_left_masked_end(self, m_block: Int) -> Int:
        """KV blocks n < this may hold keys left of some row's window: they need masking (local masks only)."""
        last_row = self.last_query(m_block)
        # Block n is clear of the left edge iff its first key n*tile_n >= last_row + off - left.
        return _ceil_div_nonneg(int_max(last_row + self.offset - self.left, 0), self.tile_n)

    # ----------------------------------------------------------------------------------------------------------------
    # Backward direction: query blocks of one KV block.
    # ----------------------------------------------------------------------------------------------------------------
    def q_block_range(self, n_block: Int) -> Tuple[Int, Int]:
        """[m_block_min, m_block_max) of the query blocks with at least one row that sees a key of `n_block`.

        Keys past seqlen_k and rows past seqlen_q do not widen the range, so that it agrees with `kv_block_range`
        (n_block is in kv_block_range(m) iff m is in this range), which the deterministic backward's turn order
        relies on; a KV block no row sees gives an empty range.
        """
        m_block_max = _ceil_div_nonneg(self.seqlen_q, self.tile_m)
        m_block_min = 0
        if self.has_right_bound:
            # Row i reaches key j iff j <= i + off + right, i.e. i >= first_key - off - right.
            first_key = n_block * self.tile_n
            first_row = first_key - self.offset - self.right
            m_block_min = int_max(first_row, 0) // self.tile_m
            if self.mask == "local":
                # A right bound below 0 can put that first row past seqlen_q, inside the last block's padding rows:
                # then no block (this term is m_block_max there, and at most the one above for a first row before
                # seqlen_q). Causal masks (right 0) never get there: a key tile's first key is below seqlen_k.
                m_block_min = int_max(m_block_min, int_min(first_row, self.seqlen_q) - self.seqlen_q + m_block_max)
        if self.has_left_bound:
            # Row i reaches key j iff j >= i + off - left, i.e. i <= last_key - off + left.
            last_key = int_min((n_block + 1) * self.tile_n, self.seqlen_k) - 1
            row_end = int_max(int_min(last_key - self.offset + self.left + 1, self.seqlen_q), 0)
            m_block_max = _ceil_div_nonneg(row_end, self.tile_m)
            # As in kv_block_range: the rows that see the tile's keys are one interval, or none.
            row_start = int_max(first_key - self.offset - self.right, 0)
            m_block_max = _select(self._no_keys(row_start, row_end), m_block_min, m_block_max)
        return m_block_min, m_block_max

    def q_right_masked_end(self, n_block: Int) -> Int:
        """Query blocks m < this have a row whose right edge cuts `n_block`: they need masking (causal / local)."""
        last_key = (n_block + 1) * self.tile_n - 1
        # Block m is clear iff its first row m*tile_m satisfies last_key <= m*tile_m + off + right.
        return _ceil_div_nonneg(int_max(last_key - self.offset - self.right, 0), self.tile_m)

    def q_left_masked_start(self, n_block: Int) -> Int:
        """Query blocks m >= this have a row whose left edge cuts `n_block`: they need masking (local only)."""
        first_key = n_block * self.tile_n
        # Block m is clear iff its last row (m+1)*tile_m - 1 satisfies first_key >= row + off - left.
        return int_max(first_key - self.offset + self.left + 1, 0) // self.tile_m

    def tile_needs_mask(self, m_block: Int, n_block: Int) -> Int:
        """Whether tile (m_block, n_block) needs element-wise masking: it holds keys past seqlen_k, or some row of it
        has a window edge inside it. Rows past seqlen_q do not make it False; with a local window's left edge they
        may make it True (those rows are never stored: it only masks more).

        Combined with `|` so it works on Python bools and on DSL booleans alike.
        """
        needs = (n_block + 1) * self.tile_n > self.seqlen_k
        if self.has_right_bound:
            needs = needs | (m_block < self.q_right_masked_end(n_block))
        if self.has_left_bound:
            needs = needs | (m_block >= self.q_left_masked_start(n_block))
        return needs


def split_kv_range(n_min: Int, n_max: Int, split: Int, splits: Int) -> Tuple[Int, Int]:
    """Run `split` of `splits` over the key tiles [n_min, n_max) of a query tile (split-key decoding,
    arch/split_kv.py): [lo, hi) with equal runs of ceil(tiles / splits), the last ones shorter or empty (lo >= hi);
    an empty range stays empty."""
    per_split = _ceil_div_nonneg(int_max(n_max - n_min, 0), splits)
    lo = int_min(n_min + split * per_split, n_max)
    return lo, int_min(lo + per_split, n_max)
