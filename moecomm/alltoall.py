"""The public dispatch/combine API, after pplx-kernels' ``AllToAll`` (framework-neutral)."""
import numpy as np

from . import _arrays
from ._config import AllToAllConfig
from ._constants import timeout_seconds
from ._dtypes import float32
from ._errors import InvalidArgument
from .transport.base import CombineArgs, DispatchArgs

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))


def stream_handle(stream):
    """A CUDA stream handle (int) from None (CuPy's current stream), an int, or an object with
    ``__cuda_stream__`` (cuda.core), ``.ptr`` (CuPy) or ``.cuda_stream`` (PyTorch)."""
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("ptr", "cuda_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise InvalidArgument(f"stream: cannot get a CUDA stream handle from {type(stream).__name__}")


def _address(buf):
    """Where an array checked by AllToAll._array starts (0 for None)."""
    if buf is None:
        return 0
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0]
    return buf.ptr


class AllToAll:
    """Expert-parallel dispatch and combine over a :class:`moecomm.Communicator`.

    Construction is collective: every rank must pass the same configuration (checked; a mismatch raises
    InvalidArgument on every rank). Buffers are sized once for the worst case and reused by every call, so
    each dispatch must be followed by its combine before the next dispatch, and the calls of one AllToAll
    must run in order on the device (one stream, or streams ordered with events). Use one AllToAll per
    concurrently live layer.

    Args:
        comm: the :class:`moecomm.Communicator`.
        max_num_tokens: most tokens a rank dispatches in one call.
        num_experts: experts in total, a multiple of the world size (rank r owns experts
            r*E/W ... (r+1)*E/W - 1).
        experts_per_token: top-k, 1..16.
        hidden_dim: values per token; a row must be a multiple of 16 bytes in ``in_dtype`` and ``out_dtype``.
        hidden_dim_scale: float32 block scales per token (e.g. hidden_dim // 128 for FP8), or None.
        in_dtype: dtype of dispatched tokens: bfloat16, float16 or float8_e4m3fn (numpy/ml_dtypes dtype
            or its name).
        out_dtype: dtype of expert outputs and combined tokens: bfloat16 or float16.
        scale_dtype: float32 (the default when hidden_dim_scale is given), or None.
        dp_size: ranks per data-parallel group; a group's ranks hold the same tokens, share the sending
            and each receives the whole combined result.
        timeout: seconds any wait may last (default: the communicator's).
    """

    def __init__(self, comm, max_num_tokens, num_experts, experts_per_token, hidden_dim,
                 hidden_dim_scale=None, in_dtype="bfloat16", out_dtype="bfloat16", scale_dtype=None,
                 dp_size=1, timeout=None):
        self.comm = comm
        args = (max_num_tokens, num_experts, experts_per_token, hidden_dim, hidden_dim_scale,
                str(in_dtype), str(out_dtype), str(scale_dtype), dp_size)
        everyone = comm.allgather(args)
        differ = [r for r, a in enumerate(everyone) if a != everyone[0]]
        if differ:
            raise InvalidArgument(f"AllToAll arguments differ across ranks: rank {differ[0]} passed "
                                  f"{everyone[differ[0]]}, rank 0 passed {everyone[0]}")
        self.cfg = AllToAllConfig.create(comm.world_size, comm.rank, max_num_tokens, num_experts,
                                         experts_per_token, hidden_dim, hidden_dim_scale, in_dtype,
                                         out_dtype, scale_dtype, dp_size)
        self.timeout_s = comm.timeout_s if timeout is None else timeout_seconds(timeout)[0]
        self._memory = comm.transport.memory
        self._backend = comm.transport.new_alltoall(self.cfg, self.timeout_s)
        self._posted = {"dispatch": False, "combine": False}  # a send half waits for its receive half
        self._dispatch_weights = None   # whether the last dispatch send carried router weights
        self._dispatch_outputs = None   # addresses of the output arrays given to the last dispatch send
        self._combine_weights = None    # whether the posted combine send was given weights

    # ------------------------------------------------------------------------------------------
    def _array(self, obj, name, dtype, shape, optional=False):
        if obj is None:
            if optional:
                return None
            raise InvalidArgument(f"{name}: required, got None")
        if self._memory == "host":
            return _arrays.host_array(obj, name, dtype, shape)
        buf = _arrays.device_array(obj, name, dtype, shape, self.comm.transport.device)
        if buf.ptr % 16:
            raise InvalidArgument(f"{name}: device pointer {buf.ptr:#x} must be 16-byte aligned")
        return buf

    def _index_dtype(self, indices):
        dt = getattr(indices, "dtype", None)
        if dt is None and hasattr(indices, "__cuda_array_interface__"):
            dt = indices.__cuda_array_interface__["typestr"]
        dt = np.dtype(dt) if dt is not None else np.dtype(np.int32)
        if dt not in _INDEX_DTYPES:
            raise InvalidArgument(f"indices: dtype {dt} not supported; expected int32 or uint32")
        return dt

    def _live(self):
        if self._backend is None:
            raise InvalidArgument("this AllToAll was destroyed")

    def _rows(self, obj, name):
        if not hasattr(obj, "shape"):
            self._array(obj, name, None, None)  # raises: says which kinds of array are accepted
        shape = tuple(obj.shape)
        if len(shape) != 2 or not 0 <= shape[0] <= self.cfg.max_num_tokens:
            raise InvalidArgument(f"{name}: expected a 2-D array of at most max_num_tokens="
                                  f"{self.cfg.max_num_tokens} rows, got shape {shape}")
        return shape[0]

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                 indices, bound_m, do_send=True, do_recv=True, weights=None, stream=None):
        """Send each token to the ranks of its experts and lay it out per local expert. Collective.

        Args (``m`` = tokens this call, read from ``bound_m``; rows = dp_x.shape[0] >= m):
            out_expert_num_tokens: [num_local_experts] int32, written: tokens received per local expert.
            out_expert_x: [num_local_experts, max_num_tokens * (world_size // dp_size), hidden_dim]
                in_dtype, written: slots 0..count-1 of each expert hold its tokens (order unspecified).
            out_expert_x_scale: [num_local_experts, same capacity, hidden_dim_scale] float32, written
                like out_expert_x; None when the AllToAll has no scales.
            dp_x: [rows, hidden_dim] in_dtype, the tokens (identical on every rank of a DP group).
            dp_x_scale: [rows, hidden_dim_scale] float32, or None without scales.
            indices: [rows, experts_per_token] int32 or uint32 expert ids, distinct per row.
            bound_m: [1] int32 holding m (a device array on GPUs, numpy on the host transport).
            do_send, do_recv: run the send half, the receive half, or both (the default). A send must be
                followed by a receive before the next send; other work may run between them. Both halves
                must be given the same output arrays: the send half already stores the tokens for this
                rank's own experts into them.
            weights: [rows, experts_per_token] float32 router weights, or None. When given, combine may
                be called with weights=None and then sums each token's local expert outputs on the
                expert side, sending fewer bytes back.
            stream: CUDA stream for device transports (default: CuPy's current stream).

        Raises InvalidArgument (bad argument, nothing sent), InvalidRouting (an expert id out of range
        or repeated within a row, on any rank), CommTimeout (a peer did not answer in time).
        """
        self._live()
        c = self.cfg
        rows = self._rows(dp_x, "dp_x")
        scaled = c.hidden_dim_scale is not None
        if not scaled and (out_expert_x_scale is not None or dp_x_scale is not None):
            raise InvalidArgument("this AllToAll has no scales (hidden_dim_scale=None): pass None for "
                                  "out_expert_x_scale and dp_x_scale")
        a = DispatchArgs(
            out_expert_num_tokens=self._array(out_expert_num_tokens, "out_expert_num_tokens", np.int32,
                                              (c.num_local_experts,)),
            out_expert_x=self._array(out_expert_x, "out_expert_x", c.in_dtype, c.expert_x_shape()),
            out_expert_x_scale=self._array(out_expert_x_scale, "out_expert_x_scale", float32,
                                           c.expert_x_scale_shape(), optional=not scaled)
            if scaled else None,
            dp_x=self._array(dp_x, "dp_x", c.in_dtype, (rows, c.hidden_dim)),
            dp_x_scale=self._array(dp_x_scale, "dp_x_scale", float32, (rows, c.hidden_dim_scale))
            if scaled else None,
            indices=self._array(indices, "indices", self._index_dtype(indices),
                                (rows, c.experts_per_token)),
            bound_m=self._array(bound_m, "bound_m", np.int32, (1,)),
            weights=self._array(weights, "weights", float32, (rows, c.experts_per_token), optional=True),
        )
        outputs = tuple(_address(b) for b in (a.out_expert_num_tokens, a.out_expert_x, a.out_expert_x_scale))
        if do_recv and not do_send and self._posted["dispatch"] and outputs != self._dispatch_outputs:
            raise InvalidArgument("dispatch: the receive half got other output arrays than the send half "
                                  "(out_expert_num_tokens, out_expert_x, out_expert_x_scale must be the same)")
        self._split("dispatch", self._backend.dispatch, a, do_send, do_recv, stream)
        if do_send:
            self._dispatch_weights = weights is not None
            self._dispatch_outputs = outputs

    def combine(self, out_tokens, indices, weights, expert_y, bound_m, do_send=True, do_recv=True,
                stream=None):
        """Send expert outputs back and form each token's router-weighted sum. Collective.

        Args:
            out_tokens: [rows, hidden_dim] out_dtype, written: rows 0..m-1 get
                sum_k weights[t, k] * expert_y(expert k of token t), accumulated in float32.
            indices: [rows, experts_per_token] int32/uint32, as given to dispatch.
            weights: [rows, experts_per_token] float32, or None to use the weights sent with dispatch
                (summed on the expert side).
            expert_y: [num_local_experts, capacity, hidden_dim] out_dtype, laid out like out_expert_x.
            bound_m: [1] int32 holding the same m as the dispatch.
            do_send, do_recv, stream: as in :meth:`dispatch`.
        """
        self._live()
        c = self.cfg
        rows = self._rows(out_tokens, "out_tokens")
        a = CombineArgs(
            out_tokens=self._array(out_tokens, "out_tokens", c.out_dtype, (rows, c.hidden_dim)),
            indices=self._array(indices, "indices", self._index_dtype(indices),
                                (rows, c.experts_per_token)),
            weights=self._array(weights, "weights", float32, (rows, c.experts_per_token), optional=True),
            expert_y=self._array(expert_y, "expert_y", c.out_dtype, c.expert_x_shape()),
            bound_m=self._array(bound_m, "bound_m", np.int32, (1,)),
        )
        if self._dispatch_weights is None:
            raise InvalidArgument("combine: no dispatch has completed on this AllToAll")
        if weights is None and not self._dispatch_weights:
            raise InvalidArgument("combine: weights=None needs the router weights to have been passed to "
                                  "dispatch(weights=...)")
        if do_recv and not do_send and (weights is not None) != self._combine_weights:
            raise InvalidArgument("combine: give weights to both halves or to neither")
        self._split("combine", self._backend.combine, a, do_send, do_recv, stream)
        if do_send:
            self._combine_weights = weights is not None

    def _split(self, phase, run, args, do_send, do_recv, stream):
        """Run the send and/or receive half of a phase, refusing an order that would deadlock or lose data."""
        posted, do_send, do_recv = self._posted[phase], bool(do_send), bool(do_recv)
        if do_send and posted:
            raise InvalidArgument(f"{phase}: a send is already posted; call {phase}(do_send=False) first")
        if do_recv and not (posted or do_send):
            raise InvalidArgument(f"{phase}: do_recv without a prior do_send")
        run(args, do_send, do_recv, self._stream(stream))
        self._posted[phase] = (posted or do_send) and not do_recv

    def _stream(self, stream):
        return None if self._memory == "host" else stream_handle(stream)

    def synchronize(self, stream=None):
        """Wait for this AllToAll's work on ``stream`` and raise any error its kernels recorded
        (CommTimeout naming the peer, InvalidRouting, ...). Dispatch and combine never synchronize; errors
        of earlier calls are also raised at the start of the next call. Not collective."""
        self._live()
        self._backend.synchronize(self._stream(stream))

    def destroy(self):
        """Release the buffers (collective). Safe to call twice; later calls raise InvalidArgument."""
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
