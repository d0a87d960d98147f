"""Routing telemetry: the operator's metrics from per-step routing counts, as JSON or Prometheus text.

The input is what moecomm already returns every call: ``out_expert_num_tokens`` of every rank, i.e. the
(token, expert) pairs each expert received. Stack one row per step over all ranks' experts (rank r's
local experts are experts r*L … (r+1)*L - 1) into ``counts [steps, num_experts]`` and :func:`summarize`
gives, over that window:

* per expert: share of all pairs, mean / max / p95 per step;
* per step: each rank's load (pairs on its experts) and the imbalance max / mean over ranks, with its
  mean, p95 and max over the window — a hot expert stalls every rank at the next synchronisation, so the
  per-step maximum is what costs time, not the average;
* hot experts: an expert is hot in a step when it receives more than ``hot_factor`` times the mean per
  expert of that step; for each expert the longest run of consecutive hot steps and the run it is in now;
* optional per-expert drop counts and per-phase bytes and times, passed through with their totals.

:func:`from_stats` does it from what every rank's ``AllToAll.stats()`` returned (the kernels keep the
per-call counts of a window of calls in device memory; no host sync until stats() is called).

:func:`to_json` and :func:`to_prometheus` (``prometheus_client``, the optional extra ``moecomm[prometheus]``)
export the result. Pure numpy: no GPU and no communicator needed.
"""
import json

import numpy as np

from ._errors import InvalidArgument


def summarize(counts, num_ranks, hot_factor=2.0, dropped=None, bytes_by_phase=None, times_us=None):
    """Metrics of a window of steps.

    Args:
        counts: [steps, num_experts] (token, expert) pairs each expert received per step (num_experts a
            multiple of num_ranks: contiguous ownership).
        num_ranks: ranks of expert parallelism.
        hot_factor: an expert is hot in a step above this multiple of the step's mean per expert.
        dropped: optional [num_experts] or [steps, num_experts] pairs dropped for capacity.
        bytes_by_phase: optional {phase: bytes} (e.g. summed from the benchmark), passed through.
        times_us: optional {phase: [samples]} device times per call, summarised as median and p99.

    Returns a dict of plain Python numbers and lists (see the module doc).
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0 or (c < 0).any() or not np.isfinite(c).all():
        raise InvalidArgument(f"counts: expected a non-negative [steps, num_experts] array, got shape {c.shape}")
    steps, E = c.shape
    if num_ranks < 1 or E % num_ranks:
        raise InvalidArgument(f"num_experts={E} must be a multiple of num_ranks={num_ranks}")
    total = c.sum()
    rank_load = c.reshape(steps, num_ranks, E // num_ranks).sum(axis=2)  # [steps, ranks]
    mean_rank = rank_load.mean(axis=1)
    imbalance = np.where(mean_rank > 0, rank_load.max(axis=1) / np.where(mean_rank > 0, mean_rank, 1), 1.0)
    hot = c > hot_factor * c.mean(axis=1, keepdims=True)
    longest, current = _streaks(hot)
    out = {
        "steps": steps, "num_experts": E, "num_ranks": num_ranks, "pairs": int(total),
        "expert": {
            "share": (c.sum(axis=0) / total if total else np.zeros(E)).tolist(),
            "mean": c.mean(axis=0).tolist(), "max": c.max(axis=0).astype(int).tolist(),
            "p95": np.percentile(c, 95, axis=0).tolist(),
        },
        "rank_load": {"mean": rank_load.mean(axis=0).tolist(), "max": rank_load.max(axis=0).astype(int).tolist()},
        "imbalance": {"per_step": imbalance.tolist(), "mean": float(imbalance.mean()),
                      "p95": float(np.percentile(imbalance, 95)), "max": float(imbalance.max())},
        "hot": {"factor": hot_factor, "longest_streak": longest.tolist(), "current_streak": current.tolist(),
                "experts": np.flatnonzero(longest).tolist()},
    }
    if dropped is not None:
        d = np.asarray(dropped, dtype=np.int64)
        d = d.sum(axis=0) if d.ndim == 2 else d
        if d.shape != (E,):
            raise InvalidArgument(f"dropped: expected [{E}] or [steps, {E}], got shape {np.shape(dropped)}")
        out["dropped"] = {"per_expert": d.tolist(), "total": int(d.sum())}
    if bytes_by_phase is not None:
        out["bytes"] = {k: int(v) for k, v in bytes_by_phase.items()}
    if times_us is not None:
        out["time_us"] = {k: {"median": float(np.median(v)), "p99": float(np.percentile(v, 99)), "n": len(v)}
                          for k, v in times_us.items()}
    return out


def from_stats(snapshots, hot_factor=2.0, expert_map=None):
    """:func:`summarize` over what every rank's :meth:`moecomm.AllToAll.stats` returned (gathered in rank
    order, e.g. ``comm.allgather(a2a.stats())``): the last steps all ranks' windows hold, their drops
    per expert, bytes per phase (sent, summed over ranks and peers) and, with timing, each phase's time per
    call (the slowest rank's; it is the one every rank waits for).

    With replicated experts the columns are physical slots; pass the ``expert_map`` in use to add
    ``"logical"``: per logical expert, share and mean / max / p95 per step of its replicas' pairs together.

    With tags (AllToAll num_tags) ``"by_tag"`` lists, per tag, :func:`summarize` of its pairs alone (shares, p95,
    hot streaks, imbalance) and its ``share_of_tagged``; with score_gap ``"score_gap"`` holds the bin ``edges``,
    every rank's ``tokens`` per bin over the window, the ``near_tie_share`` (bin 0) and the ``per_step`` counts.
    """
    if not snapshots:
        raise InvalidArgument("from_stats: expected one stats() dict per rank, got none")
    steps = min(len(s["window"]) for s in snapshots)
    if steps == 0:
        raise InvalidArgument("from_stats: no step in the window (telemetry_window=0, or no call yet)")
    counts = np.concatenate([np.asarray(s["window"])[-steps:] for s in snapshots], axis=1)
    dropped = np.concatenate([np.asarray(s["dropped"]) for s in snapshots])
    sent = {k: int(sum(np.sum(s["bytes"][k]) for s in snapshots)) for k in ("dispatch_sent", "combine_sent")}
    times = None
    if all(s.get("times_us") for s in snapshots):
        times = {}
        for phase in snapshots[0]["times_us"]:
            n = min(len(s["times_us"][phase]) for s in snapshots)
            if n:
                times[phase] = np.max([s["times_us"][phase][-n:] for s in snapshots], axis=0).tolist()
    out = summarize(counts, len(snapshots), hot_factor, dropped, sent, times or None)
    if all(s.get("by_tag") is not None for s in snapshots):  # every expert's pairs per tag: [steps, tags, E]
        tagged = np.concatenate([np.asarray(s["by_tag"])[-steps:] for s in snapshots], axis=2)
        total = tagged.sum()
        out["by_tag"] = [dict(summarize(tagged[:, t], len(snapshots), hot_factor), tag=t,
                              share_of_tagged=float(tagged[:, t].sum() / total) if total else 0.0)
                         for t in range(tagged.shape[1])]
    if all(s.get("score_gap") is not None for s in snapshots):  # every rank's tokens per confidence bin
        per_step = np.sum([np.asarray(s["score_gap"]["counts"])[-steps:] for s in snapshots], axis=0)
        tokens = per_step.sum(axis=0)
        out["score_gap"] = {"edges": list(snapshots[0]["score_gap"]["edges"]), "tokens": tokens.tolist(),
                            "near_tie_share": float(tokens[0] / tokens.sum()) if tokens.sum() else 0.0,
                            "per_step": per_step.tolist()}
    if expert_map is not None:
        logical = np.zeros((steps, expert_map.num_experts))
        held = expert_map.slots.ravel()
        np.add.at(logical.T, held[held >= 0], counts.T[held >= 0])
        total = logical.sum()
        out["logical"] = {"share": (logical.sum(axis=0) / total if total else logical[0] * 0).tolist(),
                          "mean": logical.mean(axis=0).tolist(), "max": logical.max(axis=0).astype(int).tolist(),
                          "p95": np.percentile(logical, 95, axis=0).tolist(), "generation": expert_map.generation}
    return out


def _streaks(hot):
    """Longest run of consecutive True per column, and the run that reaches the last row."""
    longest = np.zeros(hot.shape[1], np.int64)
    run = np.zeros(hot.shape[1], np.int64)
    for row in hot:
        run = np.where(row, run + 1, 0)
        longest = np.maximum(longest, run)
    return longest, run


def to_json(metrics, **kwargs):
    """The metrics as a JSON string (``kwargs`` go to json.dumps, e.g. indent=1)."""
    return json.dumps(metrics, **kwargs)


def to_prometheus(metrics, prefix="moecomm", labels=None):
    """The metrics in Prometheus text exposition format (bytes), through ``prometheus_client``.

    Gauges: ``<prefix>_expert_share``, ``_expert_tokens_mean``, ``_expert_tokens_max``, ``_expert_tokens_p95``
    and ``_expert_hot_streak_longest`` / ``_current`` (label ``expert``); ``_rank_tokens_mean`` and ``_max``
    (label ``rank``); ``_imbalance`` (label ``stat``: mean, p95, max); ``_dropped_pairs`` (label ``expert``)
    and ``_bytes`` (label ``phase``), ``_phase_time_us_median`` / ``_p99`` (label ``phase``) when present;
    with tags ``_tag_expert_share``, ``_tag_expert_tokens_p95``, ``_tag_expert_hot_streak_longest`` (labels
    ``tag``, ``expert``) and ``_tag_pairs`` (label ``tag``); with the score gap ``_score_gap_tokens`` (label
    ``bin``: "lo-hi") and ``_score_gap_near_tie_share``.
    ``labels`` (a dict) is added to every series, e.g.
    {"layer": "3"}.
    """
    try:
        from prometheus_client import CollectorRegistry, Gauge, generate_latest
    except ImportError:
        raise InvalidArgument("to_prometheus needs prometheus_client: pip install 'moecomm[prometheus]'") from None
    extra = dict(labels or {})
    registry = CollectorRegistry()

    def gauge(name, doc, key, values):
        g = Gauge(f"{prefix}_{name}", doc, list(extra) + [key], registry=registry)
        for i, v in (values.items() if isinstance(values, dict) else enumerate(values)):
            g.labels(*extra.values(), str(i)).set(v)

    e, h = metrics["expert"], metrics["hot"]
    gauge("expert_share", "share of all routed (token, expert) pairs over the window", "expert", e["share"])
    gauge("expert_tokens_mean", "pairs per step received by the expert, mean", "expert", e["mean"])
    gauge("expert_tokens_max", "pairs per step received by the expert, max", "expert", e["max"])
    gauge("expert_tokens_p95", "pairs per step received by the expert, 95th percentile", "expert", e["p95"])
    gauge("expert_hot_streak_longest", f"longest run of steps above {h['factor']}x the mean per expert",
          "expert", h["longest_streak"])
    gauge("expert_hot_streak_current", "current run of hot steps", "expert", h["current_streak"])
    gauge("rank_tokens_mean", "pairs per step on the rank's experts, mean", "rank", metrics["rank_load"]["mean"])
    gauge("rank_tokens_max", "pairs per step on the rank's experts, max", "rank", metrics["rank_load"]["max"])
    imb = metrics["imbalance"]
    gauge("imbalance", "max / mean rank load per step over the window", "stat",
          {k: imb[k] for k in ("mean", "p95", "max")})
    if "dropped" in metrics:
        gauge("dropped_pairs", "pairs dropped for capacity over the window", "expert", metrics["dropped"]["per_expert"])
    if "bytes" in metrics:
        gauge("bytes", "bytes moved over the window", "phase", metrics["bytes"])
    if "time_us" in metrics:
        for stat in ("median", "p99"):
            gauge(f"phase_time_us_{stat}", f"device time per call of the phase, {stat} over the window", "phase",
                  {k: v[stat] for k, v in metrics["time_us"].items()})
    if "by_tag" in metrics:
        def tag_gauge(name, doc, field):
            g = Gauge(f"{prefix}_tag_{name}", doc, list(extra) + ["tag", "expert"], registry=registry)
            for t in metrics["by_tag"]:
                for i, v in enumerate(field(t)):
                    g.labels(*extra.values(), str(t["tag"]), str(i)).set(v)
        tag_gauge("expert_share", "share of the tag's (token, expert) pairs over the window",
                  lambda t: t["expert"]["share"])
        tag_gauge("expert_tokens_p95", "the tag's pairs per step received by the expert, 95th percentile",
                  lambda t: t["expert"]["p95"])
        tag_gauge("expert_hot_streak_longest", "longest run of steps the expert was hot in the tag's traffic",
                  lambda t: t["hot"]["longest_streak"])
        gauge("tag_pairs", "(token, expert) pairs of the tag over the window", "tag",
              {str(t["tag"]): t["pairs"] for t in metrics["by_tag"]})
    if "score_gap" in metrics:
        sg = metrics["score_gap"]
        edges = sg["edges"] + [float("inf")]
        gauge("score_gap_tokens", "tokens whose gap between their largest and smallest router weight is in the bin "
              "over the window", "bin", {f"{lo:g}-{hi:g}": n for lo, hi, n in zip(edges, edges[1:], sg["tokens"])})
        gauge("score_gap_near_tie_share", "share of tokens in the near-tie bin", "stat",
              {"share": sg["near_tie_share"]})
    return generate_latest(registry)


if __name__ == "__main__":
    raise SystemExit("moecomm.telemetry is a library module, not a command: summaries and Prometheus text of "
                     "AllToAll.stats() (docs/operations.md); the load tool is python -m moecomm.loadtest.")
