"""moecomm.jax on the host transport (JAX's CPU backend; skipped without jax): the matrix of tests/mpi_jax.py
(jit, scan, fori_loop, cond, checkpoint, donation, two AllToAlls, split halves, m changing every step) on 1
and 2 ranks, the gradients (tests/mpi_jax_grad.py), the SPMD form (tests/mpi_jax_spmd.py), errors inside
jitted scanned steps (tests/mpi_jax_errors.py), and the operations' plumbing in one process. The GPU checks
run the same programs on GPUs."""
import numpy as np
import pytest

from conftest import FULL, need, run_mpi

jax = need("jax", 'pip install ".[test]" (brings JAX\'s CPU build)')
import jax.numpy as jnp  # noqa: E402

import moecomm  # noqa: E402
import moecomm.jax as mj  # noqa: E402

M, E, K, H = 8, 4, 2, 32


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=FULL)], ids=lambda n: f"ranks{n}")
def test_jax_matrix_on_host_ranks(ranks):
    p = run_mpi(ranks, "tests/mpi_jax.py", timeout=600)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_a_rank_whose_cond_skips_a_numbered_layer_is_named():
    """tests/mpi_call_ids.py --jax on 2 host ranks: the layer under lax.cond, its predicate False on one rank
    only, with call ids: OutOfStep on every rank, not calls of different steps paired."""
    p = run_mpi(2, "tests/mpi_call_ids.py", "--jax", timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.parametrize("how", [(2,), (2, "--silent"), pytest.param((3,), marks=FULL)],
                         ids=lambda h: "-".join(str(v).strip("-") for v in h))
def test_errors_in_jitted_scanned_steps_reach_every_rank(how):
    """tests/mpi_jax_errors.py: an expert id out of range, a bound_m above the rows and a capacity overflow on
    the last rank inside a jitted lax.scan: a moecomm error on every rank, the next step right; with --silent a
    rank that misses a step is named by CommTimeout."""
    p = run_mpi(how[0], "tests/mpi_jax_errors.py", *how[1:], timeout=600)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.fixture(scope="module")
def layer():
    comm = moecomm.init(transport="host")
    a2a = moecomm.AllToAll(comm, M, E, K, H, 2, "bfloat16", "bfloat16")
    yield mj.AllToAll(a2a)
    a2a.destroy()
    comm.finalize()


def _inputs(m=M - 3):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((M, E)), 1)[:, :K], jnp.int32)
    return x, jnp.ones((M, 2), jnp.float32), ids, jnp.asarray([m], jnp.int32), jnp.asarray(rng.random((M, K)),
                                                                                         jnp.float32)


def test_whole_and_split_calls_agree_and_rows_past_m_are_zero(layer):
    x, xs, ids, m, w = _inputs()

    @jax.jit
    def whole(x, xs, ids, m, w):
        counts, ex, exs = layer.dispatch(x, xs, ids, m, w)
        return counts, ex, exs, layer.combine(ids, None, ex, m)

    @jax.jit
    def split(x, xs, ids, m, w):
        counts, ex, exs = layer.dispatch_recv(layer.dispatch_send(x, xs, ids, m, w))
        return counts, ex, exs, layer.combine_recv(layer.combine_send(ids, None, ex, m))

    a, b = whole(x, xs, ids, m, w), split(x, xs, ids, m, w)
    assert int(np.asarray(a[0]).sum()) == int(m[0]) * K
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[3], np.float32), np.asarray(b[3], np.float32))
    want = np.asarray(x, np.float32) * np.asarray(w).sum(1)[:, None]  # the experts are the identity
    np.testing.assert_allclose(np.asarray(a[3], np.float32)[:int(m[0])], want[:int(m[0])], rtol=2e-2, atol=1e-2)
    assert not np.asarray(a[3], np.float32)[int(m[0]):].any()  # no uninitialised rows reach JAX


def test_router_weights_with_fewer_rows_than_the_indices_leave_no_uninitialised_rows(layer):
    """combine(weights=[rows - 2, k]) with m below both: the kernels' rows are the weights' (the fewest), the
    output has the indices' rows; every row >= m is zero, whole and split."""
    x, xs, ids, m, w = _inputs()
    short = w[:M - 2]

    @jax.jit
    def whole(x, xs, ids, m, w):
        ex = layer.dispatch(x, xs, ids, m)[1]
        return layer.combine(ids, w, ex, m)

    @jax.jit
    def split(x, xs, ids, m, w):
        ex = layer.dispatch(x, xs, ids, m)[1]
        return layer.combine_recv(layer.combine_send(ids, w, ex, m))

    want = np.asarray(x, np.float32) * np.asarray(w).sum(1)[:, None]  # the experts are the identity
    for fn in (whole, split):
        got = np.asarray(fn(x, xs, ids, m, short), np.float32)
        assert got.shape == (M, H)
        np.testing.assert_allclose(got[:int(m[0])], want[:int(m[0])], rtol=2e-2, atol=1e-2)
        assert not got[int(m[0]):].any()


def test_a_refusal_inside_jit_names_the_argument_and_the_next_call_works(layer):
    x, xs, ids, m, w = _inputs()
    with pytest.raises(Exception, match="dp_x: dtype float32"):
        jax.block_until_ready(jax.jit(lambda x: layer.dispatch(x, xs, ids, m, w))(x.astype(jnp.float32)))
    counts, ex, _ = jax.jit(lambda x: layer.dispatch(x, xs, ids, m, w))(x)
    out = jax.jit(lambda ex: layer.combine(ids, None, ex, m))(ex)
    assert int(np.asarray(counts).sum()) == int(m[0]) * K and out.shape == (M, H)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=FULL)], ids=lambda n: f"ranks{n}")
def test_gradients_match_plain_jax_on_host_ranks(ranks):
    """tests/mpi_jax_grad.py: jax.grad through one layer (jit, checkpoint, eager, both places of the router
    weights) and a scanned 2-layer stack equals plain JAX's for the tokens, experts, router and weights."""
    p = run_mpi(ranks, "tests/mpi_jax_grad.py", timeout=600)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=FULL)], ids=lambda n: f"ranks{n}")
def test_spmd_form_on_host_ranks(ranks):
    """tests/mpi_jax_spmd.py: jax.distributed.initialize, a global mesh of one device per process, the layer
    inside jax.shard_map under jit (one layer, a scanned stack, jax.grad) against plain JAX."""
    p = run_mpi(ranks, "tests/mpi_jax_spmd.py", timeout=600)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_gradients_refused_where_they_cannot_flow(layer):
    """Under jax.grad: combine(weights=None) (the weights went with dispatch) and an FP8 dispatch raise
    moecomm's InvalidArgument saying what to do, with the call over; then a differentiated call works."""
    x, xs, ids, m, w = _inputs()
    with pytest.raises(moecomm.InvalidArgument, match="pass the router weights to combine too"):
        jax.grad(lambda x: layer.combine(ids, None, layer.dispatch(x, xs, ids, m, w)[1], m)
                 .astype(jnp.float32).sum())(x)  # the combine ran (the call is over), then raised
    fp8 = mj.AllToAll(moecomm.AllToAll(layer.a2a.comm, M, E, K, H, 2, "float8_e4m3fn", "bfloat16"))
    with pytest.raises(moecomm.InvalidArgument, match="FP8"):
        jax.grad(lambda x: fp8.combine(ids, w, fp8.dispatch(x, xs, ids, m)[1].astype(jnp.bfloat16), m)
                 .astype(jnp.float32).sum())(x.astype(jnp.float8_e4m3fn))
    fp8.a2a.destroy()

    def f(x, w):
        _, ex, _ = layer.dispatch(x, xs, ids, m, w)
        return layer.combine(ids, w, ex, m).astype(jnp.float32).sum()  # summed on the expert side
    gx, gw = jax.jit(jax.grad(f, (0, 1)))(x, w)
    rows = int(m[0])
    # the experts are the identity: d/dx of sum_t sum_k w[t, k] x[t] is sum_k w[t, k]; d/dw[t, k] is sum(x[t])
    np.testing.assert_allclose(np.asarray(gx, np.float32)[:rows], np.broadcast_to(
        np.asarray(w).sum(1)[:rows, None], (rows, H)), rtol=2e-2)
    assert not np.asarray(gx, np.float32)[rows:].any()
    np.testing.assert_allclose(np.asarray(gw)[:rows], np.broadcast_to(
        np.asarray(x, np.float32).sum(1)[:rows, None], (rows, K)), rtol=2e-2, atol=2e-2)


def test_a_transport_without_gradients_refuses_them_and_the_next_call_works(layer):
    """As on a GPU transport in this release: jax.grad through dispatch is refused before anything runs, and
    through combine once the combine has run (eagerly its dispatch ran first); the next call works."""
    x, xs, ids, m, w = _inputs()
    layer.a2a._backend.gradients = False  # what a GPU backend says
    try:
        with pytest.raises(moecomm.InvalidArgument, match="constructed without them"):
            jax.grad(lambda x: layer.combine(ids, w, layer.dispatch(x, xs, ids, m, w)[1], m)
                     .astype(jnp.float32).sum())(x)
        _, ex, _ = layer.dispatch(x, xs, ids, m, w)
        with pytest.raises(moecomm.InvalidArgument, match="constructed without them"):
            jax.grad(lambda ex: layer.combine(ids, w, ex, m).astype(jnp.float32).sum())(ex)
    finally:
        del layer.a2a._backend.gradients
    counts, ex, _ = jax.jit(lambda x: layer.dispatch(x, xs, ids, m, w))(x)
    out = jax.jit(lambda ex: layer.combine(ids, None, ex, m))(ex)
    assert int(np.asarray(counts).sum()) == int(m[0]) * K and out.shape == (M, H)


def test_tags_inside_jit_are_counted_per_local_expert():
    """layer.dispatch(..., tags=...) inside jit, whole and split: the AllToAll counts the pairs each local
    expert received per tag (stats()["by_tag"]) as numpy does; tags=None counts none."""
    comm = moecomm.init(transport="host")
    try:
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", num_tags=3)
        layer = mj.AllToAll(a2a)
        x, _, ids, m, w = _inputs()
        tags = jnp.asarray(np.arange(M) % 3, jnp.int32)
        whole = jax.jit(lambda x, ids, m, w, t: layer.combine(ids, None, layer.dispatch(x, None, ids, m, w, t)[1], m))
        split = jax.jit(lambda x, ids, m, w, t: layer.combine(
            ids, None, layer.dispatch_recv(layer.dispatch_send(x, None, ids, m, w, t))[1], m))
        for fn, t in ((whole, tags), (split, tags), (whole, None)):
            fn(x, ids, m, w, t).block_until_ready()
        want = np.zeros((3, E), np.int64)
        rows = int(m[0])
        np.add.at(want, (np.repeat(np.asarray(tags)[:rows], K), np.asarray(ids)[:rows].ravel()), 1)
        by_tag = a2a.stats()["by_tag"]
        assert np.array_equal(by_tag[0], want) and np.array_equal(by_tag[1], want) and not by_tag[2].any(), by_tag
        a2a.destroy()
    finally:
        comm.finalize()


def test_quantising_dispatch_inside_jit_and_its_gradient_straight_through():
    """dispatch_wire="e4m3_ue8m0" (UE8M0 scales) through the layer inside jit: e4m3 values and scales equal the
    reference's; the gradient of dp_x is the sum of its slots' cotangents (straight through the quantisation),
    which JAX hands the layer in e4m3: a cotangent below e4m3's range becomes 0."""
    from moecomm import reference
    comm = moecomm.init(transport="host")
    try:
        h = 512  # four UE8M0 scales a token: a multiple of 4 bytes
        a2a = moecomm.AllToAll(comm, M, E, K, h, None, "bfloat16", "bfloat16", scale_dtype="ue8m0",
                               dispatch_wire="e4m3_ue8m0")
        layer = mj.AllToAll(a2a)
        _, _, ids, m, w = _inputs()
        x = jnp.asarray(np.random.default_rng(1).standard_normal((M, h)) * 5, jnp.bfloat16)
        y = jnp.zeros(a2a.cfg.expert_x_shape(), jnp.bfloat16)

        @jax.jit
        def step(x):
            counts, ex, exs = layer.dispatch(x, None, ids, m, w)
            out = layer.combine(ids, None, y, m)
            return ex.astype(jnp.float32).sum() + 0 * out.astype(jnp.float32).sum(), (counts, ex, exs)

        (_, (counts, ex, exs)), grad = jax.value_and_grad(step, has_aux=True)(x)
        rows = int(m[0])
        q, s = reference.quantize_tokens(np.asarray(x)[:rows], "e4m3_ue8m0", a2a.cfg.scale_dtype)
        ref = reference.dispatch([q], [s], [np.asarray(ids)[:rows]], E, 1, M)[0]
        assert np.array_equal(np.asarray(counts), ref["expert_num_tokens"])
        for e in range(E):
            n = int(counts[e])
            got = reference.canonical_rows(n, np.asarray(ex)[e], np.asarray(exs)[e])
            assert np.array_equal(got, reference.canonical_rows(n, ref["expert_x"][e], ref["expert_x_scale"][e]))
        slots = np.zeros(M)
        slots[:rows] = (np.asarray(ids)[:rows] >= 0).sum(1)  # each slot's cotangent is 1: its token gets one each
        assert grad.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(grad, np.float32), np.repeat(slots[:, None], h, 1))
        # the cotangent reaches the layer in e4m3 (its primal's dtype), rounded with no scale (docs/api.md):
        # 2^-8 per value survives as 2^-8, 2^-11 (below e4m3's smallest, 2^-9) becomes 0
        for c, want in ((2.0 ** -8, 2.0 ** -8), (2.0 ** -11, 0.0)):
            small = jax.jit(jax.value_and_grad(lambda x, c=c: c * step(x)[0]))(x)[1]
            assert np.array_equal(np.asarray(small, np.float32), np.repeat(slots[:, None], h, 1) * want)
        a2a.destroy()
    finally:
        comm.finalize()


def test_calls_run_outside_command_buffers_are_named_once(layer):
    """GPU handler runs outside XLA's command buffers (a small jitted step XLA runs op by op) are counted, a
    recording (a big step's first executions, then its command buffer) starts the count again; the
    UNCAPTURED_WARNING-th run in a row warns, once, naming the XLA flag that captures it."""
    import warnings
    layer._uncaptured = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            for _ in range(mj.UNCAPTURED_WARNING - 1):
                layer._count_run(False)
            layer._count_run(True)
        assert not seen
        for _ in range(3 * mj.UNCAPTURED_WARNING):
            layer._count_run(False)
    assert len(seen) == 1 and seen[0].category is RuntimeWarning
    assert "xla_gpu_graph_min_graph_size=1" in str(seen[0].message)


def test_jax_versions_outside_the_tested_range_are_refused(monkeypatch):
    """moecomm/_jax_internals.py: the version gate (setup.cfg's range), with MOECOMM_UNTESTED_JAX=1 to try."""
    from moecomm import _jax_internals as ji
    assert ji._version("0.11.2") == (0, 11, 2) and ji._version("0.10.0.dev20260101") == (0, 10, 0)
    for version, refused in (("0.8.2", True), (".".join(map(str, ji.MIN_VERSION)), False),
                             (".".join(map(str, ji.NEXT_VERSION)), True)):
        monkeypatch.setattr(jax, "__version__", version)
        monkeypatch.delenv("MOECOMM_UNTESTED_JAX", raising=False)
        if refused:
            with pytest.raises(ji.UnsupportedJax, match="MOECOMM_UNTESTED_JAX"):
                ji._check_version()
            monkeypatch.setenv("MOECOMM_UNTESTED_JAX", "1")
        ji._check_version()


def test_moe_layers_of_the_jax_step_tool_on_the_cpu():
    """tools/jax_step.py --small on one host rank: the exchange, the simple form (x 2 between the halves), the
    whole layer (router, experts over capacity slots, residual; bfloat16 and FP8 quantised in the step) and its
    training step (value_and_grad, jax.checkpoint per layer, unrolled and scanned) checked against numpy and
    against XLA alone; the handler runs (every call on the CPU backend) counted."""
    p = run_mpi(1, "tools/jax_step.py", "--small", "--steps", "2", "--rounds", "1", "--json", "/dev/null",
                timeout=600)
    assert p.returncode == 0 and "train    bfloat16      scan" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.parametrize("layout", ["packed", "ranks"])
def test_layouts_other_than_padded_are_refused(layer, layout):
    """moecomm.jax takes the padded layout: another is refused with moecomm's InvalidArgument at construction."""
    a2a = moecomm.AllToAll(layer.a2a.comm, M, E, K, H, 2, "bfloat16", "bfloat16", layout=layout)
    try:
        with pytest.raises(moecomm.InvalidArgument, match=f"padded layout, not '{layout}'"):
            mj.AllToAll(a2a)
    finally:
        a2a.destroy()
