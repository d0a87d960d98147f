"""The MoE layer the JAX test programs (tests/mpi_jax*.py) build on moecomm.jax, and its plain-JAX reference:
router top-k, every local expert one bfloat16 matmul over its slots, the router-weighted sum per token.
Imported after JAX is (the programs start moecomm first)."""
import jax
import jax.numpy as jnp

from moecomm.reference import relative_error  # noqa: F401 (the tests' relative error)


def route(x, w, k):
    """Top-k of the router's softmax: (ids [rows, k] int32, weights [rows, k] float32)."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ w, -1), k)
    return ids, weights


def experts(ex, w):
    """Every local expert's matmul over its slots: ex [L, slots, H], w [L, H, H] -> [L, slots, H] bfloat16."""
    return jnp.einsum("lch,lhd->lcd", ex, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def reference(x, ids, wts, w_all):
    """The same layer with every expert on this device (w_all: all E experts' [E, H, H])."""
    y = jnp.einsum("mh,ehd->emd", x, w_all, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    y = y[ids, jnp.arange(x.shape[0])[:, None]]
    return (wts[..., None] * y.astype(jnp.float32)).sum(1).astype(jnp.bfloat16)
