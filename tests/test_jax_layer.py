"""moecomm.jax's plumbing on JAX's CPU backend (skipped without jax): which halves each operation runs, that
optional inputs stay optional, that split halves pass their outputs on (a receive half completes what
the send half wrote), inside jax.jit. A fake AllToAll stands in for the GPU one and writes recognisable
values through numpy views of the callback's buffers; the GPU tests run the real thing."""
from types import SimpleNamespace

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import moecomm.jax as mj  # noqa: E402
from moecomm._config import AllToAllConfig  # noqa: E402

M, E, K, H = 4, 2, 1, 16


class FakeAllToAll:
    """Records (phase, send, recv, same_outputs, with weights) per call; a send half writes 1 into every
    expert slot, a receive half adds 1 and counts; combine's receive half writes 3 + the first expert value."""

    def __init__(self, scales):
        self.cfg = AllToAllConfig.create(1, 0, M, E, K, H, scales, "float16", "float16", None, 1)
        self.comm = SimpleNamespace(transport=SimpleNamespace(memory="device"), device=0)
        self.calls = []

    def _dispatch_call(self, n, ex, exs, x, xs, idx, m, send, recv, w, stream, same_outputs):
        self.calls.append(("dispatch", send, recv, same_outputs, w is not None))
        ex = np.asarray(ex)
        if send:
            ex[...] = 1
        if recv:
            ex[...] += 1
            np.asarray(n)[...] = np.asarray(idx).size
        if exs is not None:
            np.asarray(exs)[...] = float(send) + float(recv)

    def _combine_call(self, out, idx, w, y, m, send, recv, stream):
        self.calls.append(("combine", send, recv, w is not None))
        if recv:
            np.asarray(out)[...] = 3 + np.asarray(y)[0, 0, 0]


@pytest.fixture(params=[None, 2], ids=["no-scales", "scales"])
def layer(request, monkeypatch):
    monkeypatch.setattr(mj.AllToAll, "_buffer", lambda self, b: b)  # CPU buffers: numpy views
    monkeypatch.setattr(mj.AllToAll, "_stream", staticmethod(lambda ctx: 0))  # no GPU stream on the CPU
    return mj.AllToAll(FakeAllToAll(request.param))


def _inputs(layer):
    scales = layer.a2a.cfg.hidden_dim_scale
    return (jnp.ones((M, H), jnp.float16), None if scales is None else jnp.ones((M, scales), jnp.float32),
            jnp.zeros((M, K), jnp.int32), jnp.array([M], jnp.int32), jnp.ones((M, K), jnp.float32))


def test_whole_calls_in_jit(layer):
    x, xs, idx, m, w = _inputs(layer)

    @jax.jit
    def step(x, xs, idx, m, w):
        counts, ex, exs = layer.dispatch(x, xs, idx, m, w)
        return counts, ex, exs, layer.combine(idx, None, ex, m)

    counts, ex, exs, out = step(x, xs, idx, m, w)
    assert np.asarray(counts).tolist() == [M * K] * (E // 1) and float(np.asarray(ex).max()) == 2
    assert (exs is None) == (layer.a2a.cfg.hidden_dim_scale is None)
    assert np.asarray(out).shape == (M, H) and float(np.asarray(out)[0, 0]) == 5
    assert layer.a2a.calls == [("dispatch", True, True, True, True), ("combine", True, True, False)]


def test_split_halves_pass_their_outputs_on(layer):
    x, xs, idx, m, w = _inputs(layer)

    @jax.jit
    def step(x, xs, idx, m, w):
        sent = layer.dispatch_send(x, xs, idx, m, w)
        counts, ex, exs = layer.dispatch_recv(sent)
        back = layer.combine_send(idx, w, ex, m)
        return counts, ex, exs, layer.combine_recv(back)

    counts, ex, exs, out = step(x, xs, idx, m, None if layer.a2a.cfg.hidden_dim_scale else w)
    assert float(np.asarray(ex).min()) == 2  # the receive half completed what the send half wrote
    if exs is not None:
        assert float(np.asarray(exs).max()) == 1  # written by the receive half alone
    assert float(np.asarray(out)[0, 0]) == 5
    weights = layer.a2a.cfg.hidden_dim_scale is None
    assert layer.a2a.calls == [("dispatch", True, False, True, weights), ("dispatch", False, True, False, weights),
                               ("combine", True, False, weights), ("combine", False, True, weights)]

