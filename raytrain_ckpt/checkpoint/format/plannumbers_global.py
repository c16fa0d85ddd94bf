"""DCP's global save plan computed from the ranks' ``PlanNumbers`` (``plannumbers.py``).

What DCP does item by item over every rank's plan, done per item of a base for all of its ranks
at once (``numpy`` over the ranks' marks and numbers): ``dedup_save_plans`` (each key an item's
``MetadataIndex``; a key held by several ranks goes to the holder with the fewest bytes planned so
far, among equals the first in the order DCP's set of holders iterates (``_pick``), keys taken in
the order DCP first meets them: by the first holder's rank, then its place in that rank's plan)
and ``create_default_global_save_plan`` (each tensor's chunks in rank order, their indices,
``.metadata``'s entries in the order the deduplicated plans first name them, and
``dict(ChainMap(...))`` of the ranks' planner data).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from raytrain_ckpt.checkpoint.format.plannumbers import OWN, SAME, Central, PlanBook, PlanNumbers, planner_of

__all__ = ["plan_on_numbers"]


def _key(item: WriteItem) -> tuple:
    offset = item.index.offset
    return (item.index.fqn, None if offset is None else tuple(offset))


def _size(item: WriteItem) -> int:
    return item.tensor_storage_size() or 1


class _Group:
    """The ranks of one base: their marks and numbers as matrices."""

    def __init__(self, book: PlanBook, b: int, ranks: list[int], pns: list[PlanNumbers]) -> None:
        self.base = book.bases[b]
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.marks = np.frombuffer(b"".join(pns[r].marks for r in ranks), dtype=np.uint8).reshape(len(ranks), -1)
        width = self.base.width[-1]
        self.numbers = (np.frombuffer(b"".join(pns[r].numbers.tobytes() for r in ranks), dtype=np.int64)
                        .reshape(len(ranks), width) if width else np.zeros((len(ranks), 0), dtype=np.int64))
        self.keep = np.ones_like(self.marks)
        self.keep[self.marks == OWN] = 0  # an own item's keep is set by its key below
        self.row = {r: i for i, r in enumerate(ranks)}


def plan_on_numbers(book: PlanBook, pns: list[PlanNumbers],
                    chunk_arrays: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                    ) -> tuple[list[Central], Metadata] | None:
    """Each rank's central plan (as numbers) and the global ``Metadata``, as DCP's
    ``DefaultSavePlanner`` (load-balanced dedup) would make them from the expanded plans; None for
    a layout the numbers do not model (then DCP's planner decides, and raises what it raises).
    ``chunk_arrays``: filled with fqn -> (offsets, sizes), arrays of shape (chunks, dims), for each
    tensor whose chunks are a base's shards (the same chunks as the ``Metadata``'s, in order), so
    that ``.metadata`` can be written from them (``format/metaemit.py``)."""
    n = len(pns)
    if any(pn.planner is None for pn in pns):  # planner data of another shape than its base's: DCP's to merge
        return None
    groups: dict[int, list[int]] = {}
    for r, pn in enumerate(pns):
        groups.setdefault(pn.base, []).append(r)
    gs = {b: _Group(book, b, ranks, pns) for b, ranks in groups.items()}

    # Keys not at a base's shard positions: (fqn, offset) -> [size, sites: (group, position) or (rank, position)]
    shard_fqns: dict[str, tuple[int, int]] = {}
    for b, g in gs.items():
        for p in g.base.shard_at:
            fqn = g.base.plan.items[p].index.fqn
            if fqn in shard_fqns:
                return None
            shard_fqns[fqn] = (b, p)
    keys: dict[tuple, list] = {}
    for b, g in gs.items():
        shard_pos = set(g.base.shard_at)
        for p, ref in enumerate(g.base.plan.items):
            if p not in shard_pos:
                keys.setdefault(_key(ref), [_size(ref), []])[1].append(("g", b, p))
    for r, pn in enumerate(pns):
        seen = set()
        for p, item in pn.own.items():
            k = _key(item)
            if k in seen:
                return None
            seen.add(k)
            keys.setdefault(k, [_size(item), []])[1].append(("r", r, p))
    if any(k[0] in shard_fqns for k in keys):
        return None

    # Holders of each key, ascending ranks, and where DCP first meets it: (first rank, its position there).
    n_events: dict[int, list[tuple[int, tuple]]] = {}
    unique_sum = [0] * n
    holders_of: dict[tuple, np.ndarray] = {}
    for k, rec in keys.items():
        parts, first, last = [], None, None
        for tag, a, p in rec[1]:
            if tag == "r":
                parts.append(np.asarray([a], dtype=np.int64))
                first = min(first, (a, p)) if first else (a, p)
                last = max(last, (a, _size(pns[a].own[p]))) if last else (a, _size(pns[a].own[p]))
            else:
                g = gs[a]
                rows = np.nonzero(g.marks[:, p] == SAME)[0]
                if len(rows):
                    parts.append(g.ranks[rows])
                    cand = (int(g.ranks[rows[0]]), p)
                    first = min(first, cand) if first else cand
                    top = (int(g.ranks[rows[-1]]), _size(g.base.plan.items[p]))
                    last = max(last, top) if last else top
        if first is None:
            continue
        rec[0] = size = last[1]  # DCP sizes a key by the item of the last plan that holds it
        holders = np.sort(np.concatenate(parts)) if len(parts) > 1 else parts[0]
        if len(np.unique(holders)) != len(holders):
            return None
        holders_of[k] = holders
        if len(holders) == 1:
            unique_sum[first[0]] += size
        else:
            n_events.setdefault(first[0], []).append((first[1], ("key", k, None, size)))

    # Base shard positions: per position, the ranks' offsets; equal offsets are one key.
    unique_rows: dict[tuple[int, int], np.ndarray] = {}
    for b, g in gs.items():
        for s, p in enumerate(g.base.shard_at):
            ref = g.base.plan.items[p]
            nd, at, size = len(ref.tensor_data.size), g.base.width[s], _size(ref)
            rows = np.nonzero(g.marks[:, p] != OWN)[0]
            mask = np.zeros(len(g.ranks), dtype=bool)
            unique_rows[(b, s)] = mask
            if len(rows) == 0:
                continue
            _, inverse, counts = np.unique(g.numbers[rows, at:at + nd], axis=0, return_inverse=True,
                                           return_counts=True)
            inverse = inverse.reshape(-1)
            alone = counts[inverse] == 1
            mask[rows[alone]] = True
            for r in g.ranks[rows[alone]].tolist():
                unique_sum[r] += size
            for u in np.nonzero(counts > 1)[0].tolist():
                members = rows[inverse == u]
                n_events.setdefault(int(g.ranks[members[0]]), []).append((p, ("shard", b, members, size)))

    # DCP's dedup, in the order it meets the keys.
    sizes = np.zeros(n, dtype=np.int64)
    orders: dict[bytes, np.ndarray] = {}
    chosen: dict[tuple, int] = {k: int(h[0]) for k, h in holders_of.items() if len(h) == 1}
    for r in range(n):
        todo = n_events.get(r)
        if not todo:
            sizes[r] += unique_sum[r]
            continue
        # This rank's keys of its own count at their places among its shared ones'.
        b = pns[r].base
        g = gs[b]
        row = g.row[r]
        alone = [(p, ("one", None, None, _size(g.base.plan.items[p])))
                 for s, p in enumerate(g.base.shard_at) if unique_rows[(b, s)][row]]
        alone += [(p, ("one", None, None, keys[_key(item)][0])) for p, item in pns[r].own.items()
                  if len(holders_of.get(_key(item), ())) == 1]
        shard_pos = set(g.base.shard_at)
        for p in np.nonzero(g.marks[row] == SAME)[0].tolist():
            if p not in shard_pos:
                k = _key(g.base.plan.items[p])
                if len(holders_of.get(k, ())) == 1:
                    alone.append((p, ("one", None, None, keys[k][0])))
        for p, (kind, k, members, size) in sorted(todo + alone, key=lambda e: e[0]):
            if kind == "one":
                sizes[r] += size
            elif kind == "key":
                pick = _pick(holders_of[k], sizes, orders)
                sizes[pick] += size
                chosen[k] = pick
            else:
                h = gs[k]
                pick = _pick(h.ranks[members], sizes, orders)
                pick_row = h.row[pick]
                sizes[pick] += size
                h.keep[members, p] = 0
                h.keep[pick_row, p] = 1

    for k, (size, sites) in keys.items():
        if k not in chosen:
            continue
        pick = chosen[k]
        for tag, a, p in sites:
            if tag == "r":
                g = gs[pns[a].base]
                g.keep[g.row[a], p] = 1 if a == pick else 0
            else:
                g = gs[a]
                col = g.marks[:, p] == SAME
                g.keep[col, p] = (g.ranks[col] == pick).astype(np.uint8)
    return _global(book, pns, gs, n, chunk_arrays)


def _pick(holders: np.ndarray, sizes: np.ndarray, orders: dict[bytes, np.ndarray]) -> int:
    """DCP's choice among a key's holders (ascending ranks): ``min(set_of_holders, key=size)``,
    so among holders of equal size the first in the order that set iterates (not always the
    lowest rank: ``list({1, 8}) == [8, 1]``)."""
    sz = sizes[holders]
    tied = holders[sz == sz.min()]
    if len(tied) == 1:
        return int(tied[0])
    key = holders.tobytes()
    place = orders.get(key)
    if place is None:
        in_order = set()
        for h in holders.tolist():  # added one by one in rank order, as DCP adds them
            in_order.add(h)
        place = np.empty(int(holders.max()) + 1, dtype=np.int64)
        place[np.fromiter(in_order, dtype=np.int64, count=len(in_order))] = np.arange(len(in_order))
        if len(holders) > 64:  # (a few sets of many ranks repeat: a group's; small ones are cheap again)
            orders[key] = place
    return int(tied[int(np.argmin(place[tied]))])


def _global(book: PlanBook, pns: list[PlanNumbers], gs: dict[int, _Group], n: int,
            chunk_arrays: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
            ) -> tuple[list[Central], Metadata] | None:
    """Chunk indices, ``.metadata``'s entries and the merged planner data of the deduplicated plans."""
    md: dict[str, Any] = {}
    shard_index: dict[int, np.ndarray] = {}
    first_at: dict[int, list[tuple[int, int, int]]] = {}
    chunks_of: dict[tuple[int, int], list] = {}
    for b, g in gs.items():
        idx = np.zeros((len(g.ranks), len(g.base.shard_at)), dtype=np.int64)
        for s, p in enumerate(g.base.shard_at):
            kept = g.keep[:, p].astype(bool) & (g.marks[:, p] != OWN)
            idx[:, s] = np.cumsum(kept) - 1
            rows = np.nonzero(kept)[0]
            if len(rows):
                first_at.setdefault(int(g.ranks[rows[0]]), []).append((p, b, s))
                ref = g.base.plan.items[p]
                nd = len(ref.tensor_data.size)
                at = g.base.width[s]
                numbers = g.numbers[rows, at:at + 2 * nd]
                chunks_of[(b, s)] = [ChunkStorageMetadata(offsets=torch.Size(v[:nd]), sizes=torch.Size(v[nd:]))
                                     for v in numbers.tolist()]
                if chunk_arrays is not None:
                    chunk_arrays[ref.index.fqn] = (numbers[:, :nd].astype(np.int64), numbers[:, nd:].astype(np.int64))
        shard_index[b] = idx
    centrals: list[Central] = []
    for r, pn in enumerate(pns):
        g = gs[pn.base]
        row = g.row[r]
        keep = g.keep[row]
        shard_pos = set(g.base.shard_at)
        index: dict[int, int] = {}
        todo = [(p, None) for p in np.nonzero(keep)[0].tolist() if p not in shard_pos or pn.marks[p] == OWN]
        todo += [(p, (b, s)) for p, b, s in first_at.get(r, [])]
        for p, site in sorted(todo, key=lambda e: e[0]):
            if site is not None:
                b, s = site
                ref = gs[b].base.plan.items[p]
                md[ref.index.fqn] = TensorStorageMetadata(properties=ref.tensor_data.properties,
                                                          size=ref.tensor_data.size, chunks=chunks_of[(b, s)])
                continue
            item = pn.own[p] if pn.marks[p] == OWN else g.base.plan.items[p]
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in md:
                    return None
                md[fqn] = BytesStorageMetadata()
                continue
            if fqn in md and (item.type != WriteItemType.SHARD or not isinstance(md[fqn], TensorStorageMetadata)):
                return None
            if item.tensor_data is None or item.tensor_data.chunk is None:
                return None
            entry = md.setdefault(fqn, TensorStorageMetadata(properties=item.tensor_data.properties,
                                                             size=item.tensor_data.size, chunks=[]))
            index[p] = len(entry.chunks)
            entry.chunks.append(item.tensor_data.chunk)
        centrals.append(Central(bytes(keep.tobytes()), shard_index[pn.base][row].copy(), index))
    if chunk_arrays is not None:  # a rank's own item of the same tensor appended a chunk: its arrays are not all
        for fqn in [f for f, (o, _) in chunk_arrays.items() if len(md[f].chunks) != len(o)]:
            del chunk_arrays[fqn]
    return centrals, Metadata(md, planner_data=_merged_planner_data(book, pns, gs))


def _merged_planner_data(book: PlanBook, pns: list[PlanNumbers], gs: dict[int, _Group]) -> Any:
    """``dict(ChainMap(*planner_data))`` over the ranks in order: keys in the order of the last rank's
    first, each with the value of the first rank that has it."""
    merged: dict = {}
    touched: dict[int, set[int]] = {}
    for r in range(len(pns) - 1, -1, -1):  # the keys' order
        pn = pns[r]
        base = book.bases[pn.base]
        if pn.base not in touched:
            merged.update(planner_of(base, pn))
            touched[pn.base] = set(pn.planner)
            continue
        places = touched[pn.base] | set(pn.planner)
        touched[pn.base] = places
        ref = base.plan.planner_data
        for p in sorted(places):
            k, v = pn.planner[p] if p in pn.planner else (base.keys[p], ref[base.keys[p]])
            if k not in merged:
                merged[k] = v
    # The values: each key's from the lowest rank that has it (set last, lowest rank last).
    values: list[tuple[int, Any, Any]] = []
    for b, g in gs.items():
        ranks = g.ranks.tolist()
        ref = g.base.plan.planner_data
        for p, k in enumerate(g.base.keys):  # a base key: from the group's lowest rank that kept it
            r = next((r for r in ranks if p not in pns[r].planner), None)
            if r is not None:
                values.append((r, k, ref[k]))
        for r in ranks:
            values.extend((r, k, v) for k, v in pns[r].planner.values())
    for _, k, v in sorted(values, key=lambda e: -e[0]):
        merged[k] = v
    return merged
