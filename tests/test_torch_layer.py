"""moecomm.torch on the host transport (CPU tensors; skipped without torch): gradients against plain PyTorch
on 1 and 2 ranks (tests/mpi_torch_grad.py), moecomm.compat.deep_ep's low-latency and normal modes
(tests/mpi_deep_ep.py, tests/mpi_deep_ep_normal.py), and refusals in one process."""
import numpy as np
import pytest

from conftest import TORCH_CPU, need, run_mpi

torch = need("torch", TORCH_CPU)

import moecomm  # noqa: E402
import moecomm.torch as mt  # noqa: E402

M, E, K, H = 8, 4, 2, 32


@pytest.mark.parametrize("ranks", [1, 2], ids=lambda n: f"ranks{n}")
def test_gradients_match_plain_torch_on_host_ranks(ranks):
    p = run_mpi(ranks, "tests/mpi_torch_grad.py", timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.parametrize("ranks", [1, 2], ids=lambda n: f"ranks{n}")
def test_deep_ep_low_latency_programs_on_host_ranks(ranks):
    """tests/mpi_deep_ep.py: moecomm.compat.deep_ep called as DeepEP's low-latency test calls it."""
    p = run_mpi(ranks, "tests/mpi_deep_ep.py", timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.parametrize("ranks", [1, 3], ids=lambda n: f"ranks{n}")
def test_deep_ep_normal_mode_on_host_ranks(ranks):
    """tests/mpi_deep_ep_normal.py: DeepEP's normal mode (test_intranode's checks, the training pattern whose
    backward swaps dispatch and combine, the refusals) on moecomm's ranks layout."""
    p = run_mpi(ranks, "tests/mpi_deep_ep_normal.py", timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_refusals_and_a_layer_of_identity_experts():
    """combine(weights=None) while autograd records, and FP8 tokens' backward, raise moecomm's
    InvalidArgument, with the call over; then the gradients of identity experts are the sums of the router
    weights and of the tokens, and nothing is recorded without grad."""
    comm = moecomm.init(transport="host")
    try:
        layer = mt.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16"))
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.standard_normal((M, H)).astype(np.float32)).to(torch.bfloat16).requires_grad_()
        ids = torch.from_numpy(np.argsort(rng.random((M, E)), 1)[:, :K].astype(np.int64))
        w = torch.from_numpy(rng.random((M, K)).astype(np.float32)).requires_grad_()
        m = torch.tensor([M - 2], dtype=torch.int32)
        _, ex, _ = layer.dispatch(x, None, ids, m, w)
        with pytest.raises(moecomm.InvalidArgument, match="pass the router weights to combine too"):
            layer.combine(ids, None, ex, m)  # the combine ran (the call is over), then raised
        _, ex, _ = layer.dispatch(x, None, ids, m, w)
        out = layer.combine(ids, w, ex, m)
        assert not out.detach().float().numpy()[M - 2:].any()  # rows >= m: zeros (the kernels write them)
        out.float().sum().backward()
        rows = M - 2
        np.testing.assert_allclose(x.grad.float().numpy()[:rows], np.broadcast_to(
            w.detach().numpy().sum(1)[:rows, None], (rows, H)), rtol=2e-2)
        assert not x.grad.float().numpy()[rows:].any()
        np.testing.assert_allclose(w.grad.numpy()[:rows], np.broadcast_to(
            x.detach().float().numpy().sum(1)[:rows, None], (rows, K)), rtol=2e-2, atol=2e-2)
        with torch.no_grad():  # inference: no plan, weights=None allowed
            _, ex, _ = layer.dispatch(x, None, ids, m, w)
            assert not layer.combine(ids, None, ex, m).requires_grad
            _, ex, _ = layer.dispatch(x, None, ids, m)  # weights at combine with fewer rows than the indices
            short = layer.combine(ids, w[:M - 1], ex, m).float().numpy()
            np.testing.assert_allclose(short[:rows], out.detach().float().numpy()[:rows], rtol=1e-2, atol=1e-2)
            assert short.shape == (M, H) and not short[rows:].any()
        layer.a2a.destroy()
        fp8 = mt.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "float8_e4m3fn", "bfloat16"))
        x8 = x.detach().to(torch.float8_e4m3fn).requires_grad_()
        _, ex, _ = fp8.dispatch(x8, None, ids, m)
        out = fp8.combine(ids, w, ex.to(torch.bfloat16), m)
        with pytest.raises(moecomm.InvalidArgument, match="FP8"):
            out.float().sum().backward()
        fp8.a2a.destroy()
    finally:
        comm.finalize()


def test_a_transport_without_gradients_refuses_them_and_the_next_call_works():
    """As on a GPU transport in this release (its backend says it computes no gradients): tokens that need
    a gradient are refused before the dispatch runs; router weights that need one, at the combine, once it has
    run; in either case the call is over and the next one works."""
    comm = moecomm.init(transport="host")
    try:
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
        layer = mt.AllToAll(a2a)
        a2a._backend.gradients = False  # what a GPU backend says
        rng = np.random.default_rng(1)
        x = torch.from_numpy(rng.standard_normal((M, H)).astype(np.float32)).to(torch.bfloat16)
        ids = torch.from_numpy(np.argsort(rng.random((M, E)), 1)[:, :K].astype(np.int32))
        w = torch.from_numpy(rng.random((M, K)).astype(np.float32))
        m = torch.tensor([M], dtype=torch.int32)
        with pytest.raises(moecomm.InvalidArgument, match="constructed without them"):
            layer.dispatch(x.clone().requires_grad_(), None, ids, m, w)
        _, ex, _ = layer.dispatch(x, None, ids, m, w)
        with pytest.raises(moecomm.InvalidArgument, match="constructed without them"):
            layer.combine(ids, w.clone().requires_grad_(), ex, m)
        _, ex, _ = layer.dispatch(x, None, ids, m, w)  # the next call works
        out = layer.combine(ids, w, ex, m)
        np.testing.assert_allclose(out.float().numpy(), x.float().numpy() * w.numpy().sum(1)[:, None], rtol=2e-2,
                                   atol=2e-2)
        a2a.destroy()
    finally:
        comm.finalize()


def test_tags_are_counted_per_local_expert():
    """layer.dispatch(..., tags=...): the AllToAll counts the pairs each local expert received per tag."""
    comm = moecomm.init(transport="host")
    try:
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", num_tags=2)
        layer = mt.AllToAll(a2a)
        rng = np.random.default_rng(1)
        x = torch.from_numpy(rng.standard_normal((M, H)).astype(np.float32)).to(torch.bfloat16)
        ids = np.argsort(rng.random((M, E)), 1)[:, :K].astype(np.int64)
        tags = np.arange(M, dtype=np.int32) % 2
        m = torch.tensor([M], dtype=torch.int32)
        with torch.no_grad():
            _, ex, _ = layer.dispatch(x, None, torch.from_numpy(ids), m, None, torch.from_numpy(tags))
            layer.combine(torch.from_numpy(ids), torch.ones((M, K)), ex, m)
        want = np.zeros((2, E), np.int64)
        np.add.at(want, (np.repeat(tags, K), ids.ravel()), 1)
        assert np.array_equal(a2a.stats()["by_tag"][0], want)
        a2a.destroy()
    finally:
        comm.finalize()


def test_quantising_dispatch_and_its_gradient_straight_through():
    """dispatch_wire="e4m3" through the layer: e4m3 values and float32 scales equal the reference's; the gradient
    of the bf16 tokens is the sum of their slots' gradients (straight through the quantisation)."""
    from moecomm import reference
    comm = moecomm.init(transport="host")
    try:
        h = 256
        a2a = moecomm.AllToAll(comm, M, E, K, h, None, "bfloat16", "bfloat16", dispatch_wire="e4m3")
        layer = mt.AllToAll(a2a)
        rng = np.random.default_rng(2)
        x = torch.from_numpy((rng.standard_normal((M, h)) * 5).astype(np.float32)).to(torch.bfloat16)
        x.requires_grad_()
        ids = torch.from_numpy(np.argsort(rng.random((M, E)), 1)[:, :K].astype(np.int64))
        w = torch.from_numpy(rng.random((M, K)).astype(np.float32))
        rows = M - 2
        m = torch.tensor([rows], dtype=torch.int32)
        counts, ex, exs = layer.dispatch(x, None, ids, m, w)
        assert ex.dtype == torch.float8_e4m3fn and exs.dtype == torch.float32
        layer.combine(ids, w, torch.zeros(a2a.cfg.expert_x_shape(), dtype=torch.bfloat16), m)
        q, s = reference.quantize_tokens(x.detach().float().numpy().astype(moecomm.bfloat16)[:rows], "e4m3",
                                         np.float32)
        ref = reference.dispatch([q], [s], [ids.numpy()[:rows]], E, 1, M)[0]
        got_x = ex.detach().view(torch.uint8).numpy().view(moecomm.float8_e4m3fn)
        for e in range(E):
            n = int(counts[e])
            assert np.array_equal(reference.canonical_rows(n, got_x[e], exs.detach().numpy()[e]),
                                  reference.canonical_rows(n, ref["expert_x"][e], ref["expert_x_scale"][e]))
        ex.float().sum().backward()
        want = torch.zeros(M)
        want[:rows] = 2.0  # K = 2 distinct ids a token: two slots, each's gradient 1
        assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad.float(), want[:, None].expand(M, h))
        a2a.destroy()
    finally:
        comm.finalize()


def test_deep_ep_moves_expert_outputs_to_a_new_dispatch_slots():
    """compat.deep_ep's repeated combine: expert outputs laid out by one handle's slots land in the slots that
    hold the same (source rank, token) in another handle's (GPUs fill a source's slots in arrival order), the
    pairs read from each handle's src_info and layout_range; empty slots zero."""
    from moecomm.compat.deep_ep import _moved, _pairs
    for seed in range(20):
        rng = np.random.default_rng(seed)
        L, S, H, W = 3, 12, 4, 4
        handles = [(np.full((L, S), -1, np.int32), np.zeros((L, W), np.int64)) for _ in range(2)]
        for e in range(L):
            sizes = rng.integers(0, 4, W)  # slots of each source, sources in rank order from slot 0
            tokens = [rng.choice(4, n, replace=False) for n in sizes]  # the same tokens from several sources
            for (src_info, layout_range), shuffle in zip(handles, (False, True)):
                first = 0
                for q, n in enumerate(sizes):
                    src_info[e, first:first + n] = rng.permutation(tokens[q]) if shuffle else tokens[q]
                    layout_range[e, q] = first << 32 | int(n) if n else 0
                    first += n
        before, after = (_pairs(*map(torch.from_numpy, h)) for h in handles)
        y = torch.from_numpy(rng.standard_normal((L, S, H)).astype(np.float32))
        moved = _moved(y, before, after).numpy()
        source = lambda h, e, s: next(q for q in range(W) if h[1][e, q] >> 32 <= s < (h[1][e, q] >> 32) +  # noqa: E731
                                      (h[1][e, q] & 0xFFFFFFFF))
        for e in range(L):
            for s in range(S):
                if handles[1][0][e, s] < 0:
                    assert not moved[e, s].any()
                else:
                    pair = (source(handles[1], e, s), handles[1][0][e, s])
                    (old,) = [t for t in range(S) if handles[0][0][e, t] >= 0
                              and (source(handles[0], e, t), handles[0][0][e, t]) == pair]
                    assert np.array_equal(moved[e, s], y.numpy()[e, old])
