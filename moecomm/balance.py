"""Replicated experts: which logical expert each physical slot holds, and a planner that places replicas
from observed load.

The router speaks logical expert ids ``0 … E-1``; each rank holds ``slots_per_rank`` physical slots, and
an :class:`ExpertMap` names the logical expert in every slot, so a hot expert may have replicas on several
ranks. A (token, logical expert) pair goes to one of the expert's replicas; spreading the pairs evenly over
the replicas (the rule dispatch will use: by token index and source rank, so that every rank picks
differently and no rank needs another's choice) makes a replica's expected load the expert's load divided
by its replica count, which is what the planner predicts with.

:func:`plan` turns per-expert load (tokens per step, from the telemetry over a window) into a map: the
heaviest experts get the spare slots (each extra replica goes to the expert whose load per replica is
highest, which minimises the largest per-replica load), then replicas are placed heaviest first on the
least-loaded rank that has a free slot and does not hold that expert yet (greedy LPT scheduling, within
4/3 of the optimal largest rank load for these replicas; on the 18 small random Zipf cases of
tests/test_balance.py, checked by brute force, it is optimal in 9, 1.004x the optimum at the median and
1.23x at worst). With ``previous``, a replica stays where the
previous map had it when that costs at most ``tolerance`` of the mean rank load, to limit weight moves.
No dependency on a transport: pure numpy.
"""
import heapq
from dataclasses import dataclass

import numpy as np

from . import _constants as C
from ._errors import InvalidArgument


class ExpertMap:
    """Logical expert of every physical slot.

    Args:
        slots: [num_ranks, slots_per_rank] int, the logical expert held by each slot, or -1 (empty).
        num_experts: E, logical experts; each must have at least one replica, and no rank holds one twice.
        generation: a number that changes with every map in use (calls will carry it).
    """

    def __init__(self, slots, num_experts, generation=0):
        slots = np.array(slots, dtype=np.int64)
        if slots.ndim != 2 or slots.size == 0:
            raise InvalidArgument(f"slots: expected a [num_ranks, slots_per_rank] array, got shape {slots.shape}")
        if slots.min() < -1 or slots.max() >= num_experts:
            raise InvalidArgument(f"slots: logical expert ids must be in [-1, {num_experts}), got "
                                  f"[{slots.min()}, {slots.max()}]")
        held = np.bincount(slots[slots >= 0], minlength=num_experts)
        if (held == 0).any():
            raise InvalidArgument(f"slots: logical experts {np.flatnonzero(held == 0)[:8].tolist()} have no replica")
        for r, row in enumerate(slots):
            ids = row[row >= 0]
            if np.unique(ids).size != ids.size:
                raise InvalidArgument(f"slots: rank {r} holds a logical expert twice")
        self.slots, self.num_experts, self.generation = slots, int(num_experts), int(generation)
        self.num_ranks, self.slots_per_rank = slots.shape

    @classmethod
    def static(cls, num_experts, num_ranks, slots_per_rank=None, generation=0):
        """Today's placement: rank r holds experts r*E/W … (r+1)*E/W - 1, one replica each (the other
        slots empty)."""
        if num_experts % num_ranks:
            raise InvalidArgument(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
        per = num_experts // num_ranks
        spr = per if slots_per_rank is None else slots_per_rank
        if spr < per:
            raise InvalidArgument(f"slots_per_rank={spr} < {per} experts per rank")
        slots = np.full((num_ranks, spr), -1, np.int64)
        slots[:, :per] = np.arange(num_experts).reshape(num_ranks, per)
        return cls(slots, num_experts, generation)

    def replicas(self):
        """[E] replica count of each logical expert."""
        return np.bincount(self.slots[self.slots >= 0], minlength=self.num_experts)

    def table(self):
        """[E, max replicas] physical slot ids (rank * slots_per_rank + slot) of each logical expert's replicas
        in (rank, slot) order, -1 past its count."""
        flat = self.slots.ravel()
        order = np.flatnonzero(flat >= 0)
        order = order[np.argsort(flat[order], kind="stable")]
        counts = self.replicas()
        out = np.full((self.num_experts, counts.max()), -1, np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        for e in range(self.num_experts):
            out[e, :counts[e]] = order[starts[e]:starts[e] + counts[e]]
        return out

    def physical(self, indices, tokens, group, masked=()):
        """Physical slot ids (rank * slots_per_rank + slot) for logical ``indices`` [n, k] (-1 stays -1) of
        tokens ``tokens`` [n] (their index in the DP group's batch) sent by DP group ``group``, with the ranks
        ``masked`` (AllToAll.mask_ranks) stopped.

        The replica rule (the kernels' too, cuda/alltoall.cuh ``physical``): j = (token * REPLICA_TOKEN + group *
        REPLICA_GROUP) mod 2**32 mod replicas (moecomm._constants), so every token picks on its own, consecutive
        tokens spread over the replicas, and every rank can compute it; the first replica from j on (in table
        order, wrapping) whose rank is not masked, so that a stopped rank's experts are served by their other
        replicas; replica j when every replica's rank is masked (the pair is then not sent).
        """
        ids = np.asarray(indices, np.int64)
        table, counts = self.table(), self.replicas()
        h = ((np.asarray(tokens, np.uint64) * np.uint64(C.REPLICA_TOKEN) + np.uint64(group * C.REPLICA_GROUP))
             % np.uint64(2 ** 32))
        safe = np.maximum(ids, 0)
        n = counts[safe]
        j0 = (h[:, None] % n.astype(np.uint64)).astype(np.int64)
        down = np.zeros(self.num_ranks + 1, bool)  # [rank]: masked; the last entry is table's -1 padding
        down[list(masked)] = True
        live = ~down[np.where(table >= 0, table // self.slots_per_rank, -1)]  # [E, max replicas]
        j, found = j0, live[safe, j0]
        for i in range(1, int(counts.max())):  # replica j0, else the next live one
            later = (j0 + i) % n
            take = ~found & (i < n) & live[safe, later]
            j, found = np.where(take, later, j), found | take
        return np.where(ids >= 0, table[safe, j], -1)

    def rank_load(self, load):
        """[num_ranks] expected load of each rank when each expert's ``load`` ([E]) splits evenly over its
        replicas."""
        per_replica = np.asarray(load, np.float64) / self.replicas()
        return np.where(self.slots >= 0, per_replica[np.maximum(self.slots, 0)], 0.0).sum(axis=1)

    def imbalance(self, load):
        """max / mean of :meth:`rank_load` (1.0 is perfect balance)."""
        r = self.rank_load(load)
        return float(r.max() / r.mean()) if r.mean() > 0 else 1.0

    def moved(self, previous):
        """Replicas this map places on a rank that did not hold that expert in ``previous`` (weights to
        copy when switching)."""
        return sum(len(set(row[row >= 0]) - set(old[old >= 0])) for row, old in zip(self.slots, previous.slots))

    def __eq__(self, other):
        return isinstance(other, ExpertMap) and np.array_equal(self.slots, other.slots)

    def __repr__(self):
        return (f"ExpertMap({self.num_ranks} ranks x {self.slots_per_rank} slots, {self.num_experts} experts, "
                f"generation {self.generation})")


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` returns.

    Attributes:
        map: the :class:`ExpertMap`.
        rank_load: [num_ranks] predicted load per rank.
        imbalance: predicted max / mean rank load.
        bound: a lower bound of the largest rank load of any placement with these slots: max(total load /
            ranks, the largest load per replica when spare slots go to the heaviest experts).
        moves: replicas placed where ``previous`` did not have them (0 without ``previous``).
    """
    map: ExpertMap
    rank_load: np.ndarray
    imbalance: float
    bound: float
    moves: int

    @property
    def gap(self):
        """Predicted largest rank load over :attr:`bound` (1.0: provably optimal)."""
        return float(self.rank_load.max() / self.bound) if self.bound > 0 else 1.0


def replica_counts(load, total_slots):
    """[E] replicas per expert: one each, then every spare slot to the expert whose load per replica is the
    largest (ties to the lower id), which minimises the largest load per replica."""
    load = np.asarray(load, np.float64)
    counts = np.ones(load.size, np.int64)
    heap = [(-load[e], e) for e in range(load.size)]
    heapq.heapify(heap)
    for _ in range(total_slots - load.size):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def plan(load, num_ranks, slots_per_rank, previous=None, tolerance=0.05, max_replicas=None, generation=None):
    """Place replicas of logical experts on ranks from their load.

    Args:
        load: [E] non-negative load of each logical expert (e.g. mean tokens per step over a window).
        num_ranks, slots_per_rank: the physical slots (num_ranks * slots_per_rank >= E).
        previous: an :class:`ExpertMap` in use; a replica stays on a rank that already holds its expert when
            that rank's load stays within ``tolerance`` × mean rank load of the best choice.
        max_replicas: most replicas of one expert (default: num_ranks, since a rank holds an expert once).
        generation: the new map's generation (default: previous.generation + 1, else 0).

    Returns a :class:`Plan`.
    """
    load = np.asarray(load, np.float64)
    E, W, spr = load.size, int(num_ranks), int(slots_per_rank)
    if load.ndim != 1 or E == 0 or not np.isfinite(load).all() or (load < 0).any():
        raise InvalidArgument(f"load: expected a 1-D array of finite non-negative loads, got shape {load.shape}")
    if W < 1 or spr < 1 or W * spr < E:
        raise InvalidArgument(f"{W} ranks x {spr} slots cannot hold {E} experts")
    if previous is not None and (previous.num_experts != E or previous.slots.shape != (W, spr)):
        raise InvalidArgument(f"previous: a map of {previous.num_ranks}x{previous.slots_per_rank} slots and "
                              f"{previous.num_experts} experts, this plan is {W}x{spr} and {E}")
    cap = min(W, W if max_replicas is None else int(max_replicas))
    counts = np.minimum(replica_counts(load, W * spr), cap)
    per_replica = load / counts
    bound = max(load.sum() / W, float(per_replica.max()))
    # replicas heaviest first (ties: lower expert id), each on the least-loaded rank that can take it
    order = sorted(((per_replica[e], e) for e in range(E) for _ in range(counts[e])), key=lambda t: (-t[0], t[1]))
    slots = np.full((W, spr), -1, np.int64)
    used = np.zeros(W, np.int64)
    rank_load = np.zeros(W)
    holds = [set() for _ in range(W)]
    had = [set(row[row >= 0].tolist()) for row in previous.slots] if previous is not None else None
    slack = tolerance * load.sum() / W
    for w, e in order:
        free = [r for r in range(W) if used[r] < spr and e not in holds[r]]
        if not free:  # the ranks with free slots all hold e already: one replica fewer, a slot left empty
            continue
        best = min(free, key=lambda r: (rank_load[r], r))
        if had is not None:
            keep = [r for r in free if e in had[r] and rank_load[r] <= rank_load[best] + slack]
            if keep:
                best = min(keep, key=lambda r: (rank_load[r], r))
                had[best].discard(e)  # one replica per previous placement
        slots[best, used[best]] = e
        used[best] += 1
        rank_load[best] += w
        holds[best].add(e)
    if generation is None:
        generation = 0 if previous is None else previous.generation + 1
    new = ExpertMap(slots, E, generation)
    moves = 0 if previous is None else new.moved(previous)
    return Plan(new, new.rank_load(load), new.imbalance(load), bound, moves)


if __name__ == "__main__":
    raise SystemExit("moecomm.balance is a library module, not a command: replica plans for "
                     "AllToAll.set_expert_map (docs/operations.md).")
