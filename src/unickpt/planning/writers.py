"""Who writes which chunk: the boxes ranks hold, turned into the chunks a save writes.

:func:`assign_writers` is the one step that decides what is written and by whom; it is pure, so
every rank runs it over the same input and reaches the same answer. Its input is the distinct
boxes of each group of tensors split alike, with the ranks holding each box
(:class:`HeldBoxes`); its output is one :class:`WriteLayout` per distinct way of writing such a
group: the chunks (a box as held, or a share of one) and the rank writing each. The work is per
group and per distinct box, never per box of every tensor: a model whose layers are split alike
costs as much as one layer.

The rules, in the order they are applied:

1. A box held by one rank is written whole by it.
2. A box held by ``n`` ranks and of at least ``2 * share_bytes`` bytes is cut along its first
   dimension longer than one into ``k = min(n, bytes // share_bytes, that length)`` shares of
   about equal rows, each written by another of its holders (ascending): share ``i`` of the
   ``j``-th tensor of a group goes to holder ``(t + j * k + i) mod n``, ``t`` counting the
   shares of the groups before, so across tensors and groups every holder writes about as much
   (with ``k = n``, every holder one share of each box). Rows of a row-major box are
   contiguous in memory and in the chunk, so a share is written from a view and read back like
   any chunk.
3. A box held by several ranks and too small to cut is written whole by the least-loaded of its
   holders (then the lowest rank), tensors with the largest such boxes first. Where the boxes of
   a tensor have disjoint holders (replica groups) they are decided at once, otherwise one by one,
   largest first.

A further way of cutting boxes (smaller chunks than a shard, say) belongs in :func:`_cut`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class HeldBoxes:
    """Tensors split alike (same shape, element size and boxes on every rank).

    ``tensors``: their positions in the plan's names (ascending). ``cells``: their distinct
    boxes as packed rows (see :mod:`unickpt.planning.packed`). ``holders``: the ranks holding
    each cell (ascending), cell after cell, ``holder_counts`` of them per cell.
    """

    tensors: np.ndarray
    ndim: int
    itemsize: int
    cells: np.ndarray
    holders: np.ndarray
    holder_counts: np.ndarray


@dataclass(frozen=True, eq=False)
class WriteLayout:
    """How some tensors are written: ``coords`` (one packed row per chunk), ``writers`` (the
    rank writing each chunk) and ``held`` (the box each chunk is cut from, as packed rows;
    None where every chunk is a box as held)."""

    ndim: int
    coords: np.ndarray
    writers: np.ndarray
    held: np.ndarray | None = None

    def numel(self) -> np.ndarray:
        """Elements of each chunk."""
        return numel(self.coords)


def numel(coords: np.ndarray) -> np.ndarray:
    dims = coords.shape[1] // 2
    return np.prod(coords[:, dims:], axis=1, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class _Cut:
    """A group's chunks: ``coords``/``held`` as in :class:`WriteLayout`, ``nbytes`` of each;
    the writer of each chunk decided by rule 1 (``fixed``, -1 for the others); for rule 2
    (``shares``) the position of the cell's holders (``base``), the turn of the chunk for the
    group's first tensor (``share``), ``k`` and ``n`` of each chunk and whether the writers
    turn with the tensor (``turning``); rule 3's chunks (``whole``) and their cells'
    holders."""

    coords: np.ndarray
    held: np.ndarray | None
    nbytes: np.ndarray
    fixed: np.ndarray
    shares: np.ndarray
    base: np.ndarray
    share: np.ndarray
    k: np.ndarray
    n: np.ndarray
    turning: bool
    whole: np.ndarray
    whole_holders: np.ndarray | list[np.ndarray]


def assign_writers(
    groups: Sequence[HeldBoxes], names: Sequence[str], world: int, share_bytes: int = 0
) -> tuple[tuple[WriteLayout, ...], np.ndarray]:
    """The layouts of all groups and the layout of each tensor (a position in the first, per
    position in ``names``). ``share_bytes`` 0 writes every box whole (no rule 2)."""
    cuts = []
    turn = 0  # shares handed out so far: the next group's turns start after them
    for g in groups:
        cuts.append(_cut(g, share_bytes, turn))
        turn += len(g.tensors) * int(cuts[-1].k.max(initial=0))
    load = np.zeros(world, dtype=np.int64)
    for g, c in zip(groups, cuts):  # rules 1 and 2 first: they do not look at the load
        for j in range(len(g.tensors) if c.turning else 1):
            w = _turned(g, c, j)
            mine = w >= 0
            written = np.bincount(w[mine], weights=c.nbytes[mine], minlength=world)
            load += written.astype(np.int64) * (1 if c.turning else len(g.tensors))
    picks = _balance(groups, cuts, names, load)
    layouts: list[WriteLayout] = []
    layout_of = np.zeros(len(names), dtype=np.int64)
    for gi, (g, c) in enumerate(zip(groups, cuts)):
        if not (c.turning or len(c.whole)):  # written alike: one layout for all its tensors
            layout_of[g.tensors] = len(layouts)
            layouts.append(WriteLayout(g.ndim, c.coords, _turned(g, c, 0), c.held))
            continue
        seen: dict[bytes, int] = {}
        for j, t in enumerate(g.tensors.tolist()):
            w = _turned(g, c, j)
            if len(c.whole):
                w[c.whole] = picks[(gi, j)]
            found = seen.get(w.tobytes())
            if found is None:
                found = seen[w.tobytes()] = len(layouts)
                layouts.append(WriteLayout(g.ndim, c.coords, w, c.held))
            layout_of[t] = found
    return tuple(layouts), layout_of


def _cut(g: HeldBoxes, share_bytes: int, turn: int) -> _Cut:
    """Rules 1 and 2: the chunks of a group and what decides their writers; the shares of its
    first tensor start at holder ``turn`` (mod the holders of each box)."""
    m, dims = len(g.cells), g.cells.shape[1] // 2
    n = g.holder_counts.astype(np.int64)
    first = np.cumsum(n) - n
    nbytes = numel(g.cells) * g.itemsize
    lengths = g.cells[:, dims:].astype(np.int64)
    dim = np.argmax(lengths >= 2, axis=1) if dims else np.zeros(m, dtype=np.int64)
    rows = lengths[np.arange(m), dim] if dims else np.ones(m, dtype=np.int64)
    k = np.ones(m, dtype=np.int64)
    if share_bytes > 0:
        k = np.minimum(np.minimum(n, nbytes // share_bytes), rows)
    split = (n > 1) & (k >= 2)
    k = np.where(split, k, 1)
    cell = np.repeat(np.arange(m), k)
    share = np.arange(len(cell)) - np.repeat(np.cumsum(k) - k, k)
    coords = g.cells[cell]
    held = None
    if split.any():
        held = coords
        coords = coords.astype(np.int64)  # copied: the shares' rows change
        d, size, kk = dim[cell], rows[cell], k[cell]
        q, r = size // kk, size % kk
        at = np.arange(len(cell))
        coords[at, d] += share * q + np.minimum(share, r)
        coords[at, dims + d] = q + (share < r)
    fixed = np.full(len(cell), -1, dtype=np.int64)
    single = (n == 1)[cell]
    fixed[single] = g.holders[first[cell[single]]]
    shares = split[cell]
    whole_cells = np.flatnonzero((n > 1) & ~split)
    whole = np.flatnonzero(((n > 1) & ~split)[cell])  # one chunk per such cell, in cell order
    return _Cut(
        coords=coords,
        held=held,
        nbytes=numel(coords) * g.itemsize,
        fixed=fixed,
        shares=shares,
        base=first[cell],
        share=share + turn,
        k=k[cell],
        n=n[cell],
        turning=len(g.tensors) > 1 and bool((split & (k < n)).any()),
        whole=whole,
        whole_holders=_holder_table(g, whole_cells, first),
    )


def _turned(g: HeldBoxes, c: _Cut, j: int) -> np.ndarray:
    """The writers by rules 1 and 2 of the group's ``j``-th tensor (-1 for rule 3's chunks)."""
    w = c.fixed.copy()
    if c.shares.any():
        s = c.shares
        w[s] = g.holders[c.base[s] + (j * c.k[s] + c.share[s]) % c.n[s]]
    return w


def _holder_table(g: HeldBoxes, cells: np.ndarray, first: np.ndarray) -> np.ndarray | list:
    """The holders of ``cells``: a matrix (a row per cell) where each has as many and no rank
    holds two of them (replica groups: decided at once), else a list of arrays."""
    if not len(cells):
        return []
    n = g.holder_counts[cells]
    if (n == n[0]).all():
        matrix = g.holders[first[cells][:, None] + np.arange(n[0])]
        if np.bincount(matrix.ravel()).max() == 1:
            return matrix
    return [g.holders[first[c] : first[c] + g.holder_counts[c]] for c in cells.tolist()]


def _balance(
    groups: Sequence[HeldBoxes], cuts: list[_Cut], names: Sequence[str], load: np.ndarray
) -> dict[tuple[int, int], np.ndarray]:
    """Rule 3: the writers of the chunks of group ``gi``'s ``j``-th tensor held by several
    ranks and written whole, by ``(gi, j)``; updates ``load``."""
    order: list[tuple[int, str, int, int]] = []
    for gi, (g, c) in enumerate(zip(groups, cuts)):
        if len(c.whole):
            largest = -int(c.nbytes[c.whole].max())
            order.extend((largest, names[t], gi, j) for j, t in enumerate(g.tensors.tolist()))
    picks: dict[tuple[int, int], np.ndarray] = {}
    for _, _, gi, j in sorted(order):
        c = cuts[gi]
        nbytes = c.nbytes[c.whole]
        holders = c.whole_holders
        if isinstance(holders, np.ndarray):
            pick = holders[np.arange(len(holders)), np.argmin(load[holders], axis=1)]
            load[pick] += nbytes  # no rank twice in ``pick``
        else:
            pick = np.empty(len(holders), dtype=np.int64)
            coords = c.coords[c.whole].tolist()
            for i in sorted(range(len(holders)), key=lambda i: (-nbytes[i], coords[i])):
                hs = holders[i]
                rank = int(hs[np.argmin(load[hs])])
                pick[i] = rank
                load[rank] += nbytes[i]
        picks[(gi, j)] = pick
    return picks
