"""The numpy reference on a hand-checked example, and routing validation."""
import numpy as np
import pytest

from moecomm import reference
from moecomm._dtypes import bfloat16, float8_e4m3fn, float8_e8m0fnu


def _example():
    # 2 ranks, 4 experts (rank 0 owns 0,1; rank 1 owns 2,3), top-2, 3 tokens per rank
    x = [np.array([[1.0], [2.0], [3.0]], np.float32), np.array([[10.0], [20.0], [30.0]], np.float32)]
    idx = [np.array([[0, 2], [1, 0], [3, 2]]), np.array([[2, 3], [0, 1], [1, 2]])]
    return x, idx


def test_dispatch_by_hand():
    x, idx = _example()
    out = reference.dispatch(x, None, idx, num_experts=4, world_size=2, max_num_tokens=3)
    assert out[0]["expert_num_tokens"].tolist() == [3, 3]
    assert out[1]["expert_num_tokens"].tolist() == [4, 2]
    assert out[0]["expert_x"].shape == (2, 6, 1)
    assert out[0]["expert_x"][0, :3, 0].tolist() == [1.0, 2.0, 20.0]
    assert out[0]["expert_x"][1, :3, 0].tolist() == [2.0, 20.0, 30.0]
    assert out[1]["expert_x"][0, :4, 0].tolist() == [1.0, 3.0, 10.0, 30.0]
    assert out[1]["expert_x"][1, :2, 0].tolist() == [3.0, 10.0]
    assert out[1]["origin"][0, :4].tolist() == [[0, 0], [0, 2], [1, 0], [1, 2]]
    assert (out[1]["origin"][1, 2:] == -1).all()


def test_combine_by_hand():
    x, idx = _example()
    out = reference.dispatch(x, None, idx, num_experts=4, world_size=2, max_num_tokens=3)
    y = [o["expert_x"] * (np.arange(2)[:, None, None] + 2 * r + 1) for r, o in enumerate(out)]  # expert e: x*(e+1)
    w = [np.array([[0.5, 0.25], [1.0, 2.0], [0.0, 1.0]], np.float32)] * 2
    got = reference.combine(idx, w, y, [o["origin"] for o in out], 4, 2, np.float32)
    assert got[0][:, 0].tolist() == [1 * (0.5 * 1 + 0.25 * 3), 2 * (1.0 * 2 + 2.0 * 1), 3 * (0 * 4 + 1.0 * 3)]
    assert got[1][:, 0].tolist() == [10 * (0.5 * 3 + 0.25 * 4), 20 * (1.0 * 1 + 2.0 * 2), 30 * (0 * 2 + 1.0 * 3)]


def test_dp_groups_share_tokens():
    x, idx = _example()
    # 4 ranks in 2 DP groups of 2: the same two groups of tokens, experts spread over 4 ranks
    out = reference.dispatch(x, None, idx, num_experts=4, world_size=4, max_num_tokens=3, dp_size=2)
    assert [o["expert_num_tokens"].tolist() for o in out] == [[3], [3], [4], [2]]


def test_routing_error():
    assert reference.routing_error(np.array([[0, 1], [2, 3]]), 4) is None
    assert "outside [0, 4)" in reference.routing_error(np.array([[0, 1], [4, 3]]), 4)
    assert "token 1" in reference.routing_error(np.array([[0, 1], [-2, 3]]), 4)
    assert reference.routing_error(np.array([[0, -1], [-1, -1]]), 4) is None  # -1: no expert, repeatable
    assert "more than once" in reference.routing_error(np.array([[0, 1], [3, 3]]), 4)
    assert reference.routing_error(np.zeros((0, 2), np.int32), 4) is None


def test_no_expert_ids_send_and_add_nothing():
    x = [np.arange(6, dtype=np.float32).reshape(3, 2)]
    idx = [np.array([[1, -1], [-1, -1], [0, 1]])]
    out = reference.dispatch(x, None, idx, num_experts=2, world_size=1, max_num_tokens=3)
    assert out[0]["expert_num_tokens"].tolist() == [1, 2]
    y = [out[0]["expert_x"]]
    got = reference.combine(idx, [np.ones((3, 2), np.float32)], y, [out[0]["origin"]], 2, 1, np.float32)[0]
    assert got.tolist() == [[0, 1], [0, 0], [8, 10]]


def test_canonical_rows_ignore_slot_order():
    a = np.arange(12, dtype=np.int32).reshape(4, 3)
    s = np.arange(4, dtype=np.float32)[:, None]
    perm = [2, 0, 3, 1]
    assert np.array_equal(reference.canonical_rows(4, a, s), reference.canonical_rows(4, a[perm], s[perm]))
    assert not np.array_equal(reference.canonical_rows(4, a, s), reference.canonical_rows(4, a[perm], s))


def _adjoint_case(seed, W=2, dp=1, M=5, K=2, H=3, E=6):
    rng = np.random.default_rng(seed)
    groups = W // dp
    idx = [np.argsort(rng.random((M, E)), axis=1)[:, :K] for _ in range(groups)]
    for i in idx:
        i[rng.random((M, K)) < 0.2] = -1
    x = [rng.standard_normal((M, H)) for _ in range(groups)]
    out = reference.dispatch(x, None, idx, E, W, M, dp_size=dp)
    return rng, idx, x, out


def test_dispatch_backward_is_the_adjoint_of_dispatch():
    """<dispatch(x), G> == <x, dispatch_backward(G)> for random G (dispatch is linear in x; accumulated in
    float32, as the transports do)."""
    for seed in range(4):
        rng, idx, x, out = _adjoint_case(seed)
        grads = [rng.standard_normal(o["expert_x"].shape) for o in out]
        back = reference.dispatch_backward(grads, [o["origin"] for o in out], [len(i) for i in idx], np.float64)
        lhs = sum(float((o["expert_x"] * g).sum()) for o, g in zip(out, grads))
        rhs = sum(float((a * b).sum()) for a, b in zip(x, back))
        assert np.isclose(lhs, rhs, rtol=1e-5), (lhs, rhs)


def test_combine_backward_gives_the_derivatives_of_combine():
    """combine is linear in expert_y and in the weights: <combine(w, y), G> equals <y, grad_expert_y> and
    <w, grad_weights>; empty slots get no gradient."""
    for seed in range(4):
        rng, idx, _, out = _adjoint_case(seed)
        origin = [o["origin"] for o in out]
        ys = [rng.standard_normal(o["expert_x"].shape) for o in out]
        w = [rng.random(i.shape) for i in idx]
        g = [rng.standard_normal((len(i), ys[0].shape[2])) for i in idx]
        comb = reference.combine(idx, w, ys, origin, 6, 2, np.float64)
        lhs = sum(float((c * gg).sum()) for c, gg in zip(comb, g))
        gy, gw = reference.combine_backward(idx, w, g, ys, origin, 6, 2)
        assert np.isclose(lhs, sum(float((y * d).sum()) for y, d in zip(ys, gy)), rtol=1e-5)
        assert np.isclose(lhs, sum(float((a * b).sum()) for a, b in zip(w, gw)), rtol=1e-5)
        for o, d in zip(origin, gy):
            assert not d[o[:, :, 0] < 0].any()


@pytest.mark.parametrize("wire,scale_dtype", [("e4m3", np.float32), ("e4m3_ue8m0", np.float32),
                                              ("e4m3_ue8m0", float8_e8m0fnu), ("e4m3_ue8m0", np.int32)])
def test_quantize_tokens_rounds_within_e4m3_and_encodes_the_scales(wire, scale_dtype):
    """quantize_tokens: every value back within 2^-4 of itself (or scale * 2^-10 below e4m3's normal range), the
    scale absmax / 448 (up to a power of two for UE8M0, 1 for zeros), UE8M0 packed first-scale-lowest in int32."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 512)) * np.exp(np.linspace(-5, 5, 512))).astype(bfloat16)
    x[0, :128] = 0
    q, s = reference.quantize_tokens(x, wire, scale_dtype)
    assert q.dtype == float8_e4m3fn and q.shape == x.shape
    if np.dtype(scale_dtype) == np.int32:
        assert s.shape == (5, 1)
        scale = s.view(np.uint8).view(float8_e8m0fnu).astype(np.float32)  # little-endian bytes in order
    else:
        assert s.shape == (5, 4) and s.dtype == np.dtype(scale_dtype)
        scale = s.astype(np.float32)
    v = x.astype(np.float32)
    amax = np.abs(v).reshape(5, 4, 128).max(-1)
    want = np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32)
    if wire == "e4m3_ue8m0":
        assert (scale >= want).all() and (scale < 2 * want).all()
        assert (np.frexp(scale)[0] == 0.5).all()  # powers of two
    else:
        assert np.array_equal(scale, want)
    back = (q.astype(np.float32).reshape(5, 4, 128) * scale[..., None]).reshape(5, 512)
    assert (np.abs(back - v) <= 2 ** -4 * np.abs(v) + np.repeat(scale, 128, axis=1) * 2 ** -10).all()
    assert not back[0, :128].any()
