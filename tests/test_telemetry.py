"""moecomm.telemetry: metrics from per-step routing counts, checked against counts computed independently,
and their JSON / Prometheus exports."""
import json

import numpy as np
import pytest

import moecomm
from conftest import need
from moecomm import telemetry


def test_metrics_of_a_known_window():
    counts = np.ones((6, 8), np.int64)  # 2 ranks x 4 experts, 6 steps
    counts[2:5, 3] = 20                 # expert 3 hot for 3 steps
    counts[5, 6] = 30                   # expert 6 hot in the last step
    m = telemetry.summarize(counts, num_ranks=2, hot_factor=2.0)
    assert m["pairs"] == int(counts.sum())
    np.testing.assert_allclose(m["expert"]["share"], counts.sum(0) / counts.sum())
    assert m["expert"]["max"][3] == 20 and m["expert"]["p95"][3] == pytest.approx(np.percentile(counts[:, 3], 95))
    rank = counts.reshape(6, 2, 4).sum(2)
    np.testing.assert_allclose(m["imbalance"]["per_step"], rank.max(1) / rank.mean(1))
    assert m["imbalance"]["max"] == pytest.approx(max(23 / 13.5, 33 / 18.5))
    assert m["hot"]["longest_streak"][3] == 3 and m["hot"]["current_streak"][3] == 0
    assert m["hot"]["longest_streak"][6] == 1 and m["hot"]["current_streak"][6] == 1
    assert m["hot"]["experts"] == [3, 6]
    assert m["rank_load"]["max"] == rank.max(0).tolist()


def test_drops_bytes_and_times_pass_through():
    counts = np.full((3, 4), 5)
    m = telemetry.summarize(counts, 2, dropped=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1]],
                            bytes_by_phase={"dispatch": 10, "combine": 20}, times_us={"dispatch": [1.0, 2.0, 3.0]})
    assert m["dropped"] == {"per_expert": [0, 3, 0, 1], "total": 4}
    assert m["bytes"] == {"dispatch": 10, "combine": 20}
    assert m["time_us"]["dispatch"]["median"] == 2.0


@pytest.mark.parametrize("counts, ranks, why", [
    (np.ones((3, 5)), 2, "multiple of num_ranks"),
    (-np.ones((3, 4)), 2, "non-negative"),
    (np.ones(4), 2, r"\[steps, num_experts\]"),
])
def test_bad_input_is_refused(counts, ranks, why):
    with pytest.raises(moecomm.InvalidArgument, match=why):
        telemetry.summarize(counts, ranks)


def test_json_and_prometheus_exports():
    need("prometheus_client", 'pip install ".[test]"')
    m = telemetry.summarize(np.arange(24).reshape(3, 8), num_ranks=2)
    assert json.loads(telemetry.to_json(m))["num_experts"] == 8
    text = telemetry.to_prometheus(m, labels={"layer": "3"}).decode()
    assert 'moecomm_expert_share{expert="7",layer="3"}' in text or 'moecomm_expert_share{layer="3",expert="7"}' in text
    assert 'moecomm_imbalance{layer="3",stat="max"}' in text
    assert "# TYPE moecomm_rank_tokens_max gauge" in text


def test_counts_from_the_host_transport_equal_the_routing():
    """out_expert_num_tokens collected over many skewed and uniform steps (split halves in some) equals
    the counts computed from the expert ids, and the summary of either is the same."""
    comm = moecomm.init(transport="host")
    E, K, H, M = 16, 4, 64, 32
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
    rng = np.random.default_rng(7)
    got, want = [], []
    for step in range(40):
        m = int(rng.integers(0, M + 1))
        p = np.ones(E) if step % 2 else 1.0 / np.arange(1, E + 1) ** 1.2
        idx = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(M)]).astype(np.int32)
        idx[rng.random((M, K)) < 0.05] = -1  # some slots go nowhere
        n = np.zeros(E, np.int32)
        x, ex = np.zeros((M, H), moecomm.bfloat16), np.zeros((E, M, H), moecomm.bfloat16)
        halves = ((True, False), (False, True)) if step % 3 == 0 else ((True, True),)
        for send, recv in halves:
            a2a.dispatch(n, ex, None, x, None, idx, np.array([m], np.int32), do_send=send, do_recv=recv)
        a2a.combine(np.zeros((M, H), moecomm.bfloat16), idx, np.ones((M, K), np.float32), ex, np.array([m], np.int32))
        got.append(n.copy())
        ids = idx[:m].ravel()
        want.append(np.bincount(ids[ids >= 0], minlength=E))
    a2a.destroy()
    comm.finalize()
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert telemetry.summarize(got, 1) == telemetry.summarize(want, 1)


def test_from_stats_joins_the_ranks_windows_and_maps_slots_to_logical_experts():
    """from_stats: the last steps every rank holds, experts in rank order, drops and bytes summed, each phase's
    time the slowest rank's; with an expert map, the replicas' pairs add up per logical expert."""
    from moecomm import balance
    win = [np.array([[1, 2, 0], [3, 4, 0], [5, 6, 0]]), np.array([[7, 8, 2], [9, 10, 1]])]  # 3 slots per rank
    snaps = [dict(window=w, dropped=np.array([0, q, 0]), bytes={"dispatch_sent": np.array([0, 10]),
                                                              "combine_sent": np.array([5, 0])},
                  times_us={"dispatch": [1.0 + q, 2.0 + q], "combine": [3.0, 4.0 - q]}) for q, w in enumerate(win)]
    emap = balance.ExpertMap(np.array([[0, 1, -1], [2, 3, 0]]), 4)
    m = telemetry.from_stats(snaps, expert_map=emap)
    assert m["steps"] == 2 and m["expert"]["max"] == [5, 6, 0, 9, 10, 2]
    assert m["dropped"]["per_expert"] == [0, 0, 0, 0, 1, 0] and m["bytes"] == {"dispatch_sent": 20, "combine_sent": 10}
    assert m["time_us"]["dispatch"]["median"] == 2.5 and m["time_us"]["combine"]["median"] == 3.5
    assert m["logical"]["max"] == [6, 6, 9, 10]  # expert 0: its slot on rank 0 plus its replica on rank 1
    assert b"moecomm_phase_time_us_median" in telemetry.to_prometheus(m)


def test_from_stats_summarizes_each_tag_and_the_score_gap():
    """With tags, each tag's pairs alone are summarized (shares, p95, hot streaks) from every rank's
    [steps, tags, L] window; the score gap's tokens per bin are summed over ranks and steps; Prometheus text
    carries the tag and bin labels."""
    need("prometheus_client", 'pip install ".[test]"')
    from moecomm import _constants as C
    rng = np.random.default_rng(3)
    by_tag = [rng.integers(0, 5, (4, 2, 3)) for _ in range(2)]  # 2 ranks, 4 steps, 2 tags, 3 local experts
    gaps = [rng.integers(0, 9, (4, C.GAP_BINS)) for _ in range(2)]
    snaps = [dict(window=t.sum(axis=1), dropped=np.zeros(3, int), bytes={"dispatch_sent": np.zeros(2),
                                                                        "combine_sent": np.zeros(2)},
                  by_tag=t, score_gap={"edges": list(C.GAP_EDGES), "counts": g}) for t, g in zip(by_tag, gaps)]
    m = telemetry.from_stats(snaps)
    for tag in range(2):
        counts = np.concatenate([t[:, tag] for t in by_tag], axis=1)  # [steps, 6 experts]
        want = telemetry.summarize(counts, 2)
        got = m["by_tag"][tag]
        assert got["tag"] == tag and got["expert"] == want["expert"] and got["hot"] == want["hot"]
        assert got["share_of_tagged"] == pytest.approx(counts.sum() / sum(t.sum() for t in by_tag))
    tokens = sum(g.sum(axis=0) for g in gaps)
    assert m["score_gap"]["tokens"] == tokens.tolist() and m["score_gap"]["edges"] == list(C.GAP_EDGES)
    assert m["score_gap"]["near_tie_share"] == pytest.approx(tokens[0] / tokens.sum())
    text = telemetry.to_prometheus(m).decode()
    assert 'moecomm_tag_expert_share{expert="5",tag="1"}' in text and 'moecomm_tag_pairs{tag="0"}' in text
    assert 'moecomm_score_gap_tokens{bin="0-0.01"}' in text and 'bin="0.5-inf"' in text
