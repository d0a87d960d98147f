"""The MoE layer the JAX test programs (tests/mpi_jax*.py) build on moecomm.jax, and its plain-JAX reference:
router top-k, every local expert one bfloat16 matmul over its slots, the router-weighted sum per token.
Imported after JAX is (the programs start moecomm first)."""
import jax
import jax.numpy as jnp
import numpy as np


def route(x, w, k):
    """Top-k of the router's softmax: (ids [rows, k] int32, weights [rows, k] float32)."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ w, -1), k)
    return ids, weights


def experts(ex, w):
    """Every local expert's matmul over its slots: ex [L, slots, H], w [L, H, H] -> [L, slots, H] bfloat16."""
    return jnp.einsum("lch,lhd->lcd", ex, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def relative_error(got, want):
    """L2 norm of got - want over that of want, in float32 (NaN compares as a failure: check ``not err < tol``)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def reference(x, ids, wts, w_all):
    """The same layer with every expert on this device (w_all: all E experts' [E, H, H])."""
    y = jnp.einsum("mh,ehd->emd", x, w_all, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    y = y[ids, jnp.arange(x.shape[0])[:, None]]
    return (wts[..., None] * y.astype(jnp.float32)).sum(1).astype(jnp.bfloat16)
