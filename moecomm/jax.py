"""JAX: dispatch and combine as JAX operations, inside ``jax.jit`` (and ``lax.scan``, ``fori_loop``,
``cond``, ``jax.checkpoint``, ``jax.grad``) or eagerly, on GPUs (on XLA's stream) and on the host transport
(JAX's CPU backend, numpy under the hood).

    import moecomm, moecomm.jax
    comm = moecomm.init()
    layer = moecomm.jax.AllToAll(moecomm.AllToAll(comm, ...))
    counts, expert_x, expert_x_scale = layer.dispatch(dp_x, dp_x_scale, indices, bound_m, weights)
    out_tokens = layer.combine(indices, None, expert_y, bound_m)     # weights went with dispatch
    ...
    layer.check()                                                    # after a step: errors the GPU recorded

Each operation is an XLA FFI custom call (``jax.ffi.ffi_call``) whose handler is moecomm's Python, registered
through XLA's FFI C API with ctypes (moecomm/_xla_ffi.py; no compiler involved): XLA allocates the outputs and
moecomm writes them in place, its kernels on XLA's stream. On GPUs the handlers are command-buffer
compatible: where XLA puts the call into a command buffer (a CUDA graph), the handler runs once while XLA
records it (its arguments are read and checked, its kernels captured: :meth:`moecomm.AllToAll.captured`) and
XLA replays the graph afterwards with no Python at all, until the buffers' addresses change. Then nothing of a
call is on the host: the kernels keep the call order (each half counts its calls; every rank runs the same
program), check what depends on the data (m, the expert ids, the ranks' agreement) and record errors on the
device, on every rank of a call that failed on any; :meth:`AllToAll.check` raises them (call it once a step's
outputs are ready; the AllToAll's next call outside a graph raises them too). Where XLA runs the call outside
a command buffer, the handler runs every time and raises what the kernels recorded so far, as an eager call
does; the call order is kept on the device either way (XLA may record one half of a call and run the other).
XLA runs a jitted function's first executions, and a sequence of fewer commands than its flag
``xla_gpu_graph_min_graph_size`` (a step of one MoE layer and little else), op by op: Python runs per call
then, as in an eager call (``XLA_FLAGS=--xla_gpu_graph_min_graph_size=1`` captures a small step too;
benchmarks/NOTES.md has the measurement). After ``UNCAPTURED_WARNING`` such runs of one AllToAll's calls in a
row (none recorded between: a big step's first executions are followed by its recording) a RuntimeWarning says
so, once. :attr:`AllToAll.handler_runs` counts the handlers' runs: in a step replayed from XLA's command buffers
it does not move (``tools/jax_step.py`` reports it per row; the GPU suite fails where Python runs per call).
A call that failed in a replayed step, which raises nothing itself, returns NaN in every row of combine's
output on every rank (``failed="nan"``, the default; ``"zeros"`` keeps zeros), so that a loss or a logit shows
it where nothing calls :meth:`AllToAll.check`.
Shapes are static, as in :class:`moecomm.AllToAll` (worst-case expert slots; ``bound_m`` is a [1] int32 array).
Split halves: :meth:`AllToAll.dispatch_send` returns a handle that :meth:`AllToAll.dispatch_recv` completes
(other JAX work may sit between them), likewise ``combine_send`` / ``combine_recv``.

An AllToAll keeps state from one call to the next (its buffers, the call sequence every rank must follow),
which XLA cannot see: to XLA a pure operation may be computed twice, dropped or merged with another. So every
operation is marked for XLA as having a side effect (never dropped or merged; to JAX it is pure, which keeps
jitted steps on JAX's C++ dispatch; never recomputed by ``jax.checkpoint``: moecomm/_jax_internals.py, the JAX
internals this takes, behind a version gate) and sits between optimization barriers:
XLA's GPU compiler otherwise fuses a scan's per-layer slicing of an operand or a result into a copy of the call
(a "dynamic-slice fusion") and keeps the original too (seen on one H200 with jax 0.11.2: a dispatch run twice
in a row; a scan whose per-layer outputs were returned ran its combine twice, the second time with no
dispatch to combine). Where JAX saves an operation's raw outputs for the backward pass (under
``jax.checkpoint`` always: a recomputed call would exchange again, with nothing to order it after the forward's
calls), past any barrier, a scan stacks them: so the forward of a differentiated dispatch or combine hands its
outputs to ``moecomm_keep``, an effectful call that only copies its operands to its results where XLA gave
them other buffers (none, unless XLA fused a copy of it), which XLA may fuse or copy freely. So each operation
runs exactly once per execution.
Data dependencies alone order the calls of one AllToAll (dispatch -> experts -> combine, a send half's handle
-> its receive half): a combine must read something its dispatch wrote (XLA removes optimization barriers
before it schedules, so a barrier is no dependency).
Gradients (the host transport; GPU transports with ``AllToAll(..., gradients=True)``): dispatch and combine
are ``jax.custom_vjp`` operations whose forward keeps its routing plan (:class:`moecomm.RoutingPlan`) as a
residual and whose backward runs :meth:`moecomm.AllToAll.dispatch_backward` / ``combine_backward`` along it,
under ``jit``, ``lax.scan`` and ``jax.checkpoint``; router weights sent with dispatch are given to combine too
(see :meth:`AllToAll.combine`). Independent AllToAlls in one jitted function run in the order XLA schedules
them, which is the same on every rank (every rank runs the same program); give them a data dependency if
another order is wanted. ``jax.vmap`` over an operation is refused: a call is collective over the ranks, not
over a batch (fold the batch into the tokens, or map over layers with ``lax.scan``).

Numerics of stacked layers: a router in front of each layer re-routes its input through top-k, so two
computations of the same stack that round differently (moecomm's kernels sum in another order than XLA; at
2+ ranks with router weights sent with dispatch, the expert side rounds its partial sums to out_dtype) can
pick another expert for a token whose top-k is nearly tied, and from there that token differs by a lot.
Compare stacks layer by layer on the same inputs, or with routing that does not depend on the activations.

Every rank's JAX must see its own GPU. JAX preallocates 75 % of every GPU it sees, so with several ranks
per node give each process one GPU before anything initialises CUDA (``CUDA_VISIBLE_DEVICES``, as
``srun --gpus-per-task=1`` does; ``examples/jax_moe.py`` shows it for mpirun), or turn preallocation off
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``) and place arrays on ``jax.devices()[comm.device]``.
The core package never imports jax; this module does.
"""
import contextlib
import ctypes
import functools
import itertools
import warnings
import weakref
from typing import NamedTuple

import jax
import numpy as np

from . import _cuda, _jax_internals, _xla_ffi
from ._arrays import DeviceBuffer, host_array
from ._errors import InvalidArgument
from .alltoall import CombineArgs, DispatchArgs, RoutingPlan, no_gradients

_KINDS = ("dispatch", "combine", "dispatch_backward", "combine_backward", "keep")  # FFI targets: moecomm_<kind>
# an operation's flags, the low byte of its one attribute (the layer's number above): its halves, a routing plan
# among its results, dispatch's outputs' starting values among its operands (moved: a send half's), whether the
# router weights are among its operands
_SEND, _RECV, _PLAN, _START, _MOVED, _WEIGHTS, _TAGS, _CALL_ID = 1, 2, 4, 8, 16, 32, 64, 128
_layers = weakref.WeakValueDictionary()  # {number: AllToAll}: whom a handler serves
UNCAPTURED_WARNING = 1000  # runs of one AllToAll's calls in a row outside XLA's command buffers before it warns
_numbers = itertools.count(1)


def _handle(kind, frame):
    """The FFI handler of every moecomm operation: the layer and flags from the frame's attribute, then the
    layer's method for ``kind`` with the frame's buffers."""
    op = _xla_ffi.int_attr(frame, "op")
    getattr(_layers[op >> 8], "_" + kind)(op & 0xFF, _xla_ffi.buffers(frame.args), _xla_ffi.buffers(frame.rets),
                                          frame)


def _register():
    """Register moecomm's handlers with XLA, once per process, for GPUs (command-buffer compatible) and JAX's
    CPU backend."""
    handlers = []
    for kind in _KINDS:
        for platform, graphs in (("cpu", False), ("CUDA", True)):
            h = _xla_ffi.handler(functools.partial(_handle, kind), graphs)
            handlers.append(h)
            capsule = jax.ffi.pycapsule(ctypes.cast(h, ctypes.c_void_p).value)
            jax.ffi.register_ffi_target(_jax_internals.PREFIX + kind, capsule, platform=platform)
    return handlers


_HANDLERS = _register()  # kept alive: XLA holds their addresses
_jax_internals.install()


def _typed(structs, like):
    """``structs`` (ShapeDtypeStructs) as result types that vary over the manual mesh axes ``like`` varies over
    inside ``jax.shard_map`` (elsewhere ``structs`` as they are): JAX's ffi_call takes its results' types as
    given, and inside shard_map a result carried by ``lax.scan`` must vary as the carry does."""
    t = jax.typeof(like)
    mesh = getattr(getattr(t, "sharding", None), "mesh", None)
    if jax.sharding.AxisType.Manual not in getattr(mesh, "axis_types", ()):
        return list(structs)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [t.update(shape=s.shape, dtype=s.dtype, weak_type=False, sharding=sharding) for s in structs]


def _fenced(op, *args):
    """``op(*args)`` with an optimization barrier on each side. XLA's GPU compiler fuses the slicing of a
    custom call's operand (a scan's per-layer slice) or of its result (a scan's stacked outputs) into a copy of
    the call, and keeps the original where it has another use or a side effect: the call then runs twice
    (seen with jax 0.11.2: a dispatch twice in a row, or a combine with no dispatch). Behind barriers XLA sees
    whole buffers on both sides and never copies the call."""
    return jax.lax.optimization_barrier(op(*jax.lax.optimization_barrier(args)))


def _unbatched(*arrays):
    """Refuse ``jax.vmap`` over an operation: a call is collective over the ranks, not over a batch."""
    if any(isinstance(a, _jax_internals.BatchTracer) for a in arrays):
        raise InvalidArgument("moecomm.jax: jax.vmap over dispatch or combine is not supported (each call is one "
                              "collective exchange of all the ranks): fold the batch into the token dimension, or "
                              "map over layers with lax.scan")


class DispatchHandle(NamedTuple):
    """A posted dispatch send: the partly written outputs and the inputs the receive half checks again."""
    out_expert_num_tokens: jax.Array
    out_expert_x: jax.Array
    out_expert_x_scale: object
    dp_x: jax.Array
    dp_x_scale: object
    indices: jax.Array
    bound_m: jax.Array
    weights: object
    tags: object = None
    call_id: object = None


class CombineHandle(NamedTuple):
    """A posted combine send: the output buffer and the inputs the receive half reads."""
    out_tokens: jax.Array
    indices: jax.Array
    weights: object
    expert_y: jax.Array
    bound_m: jax.Array


class AllToAll:
    """JAX operations over a :class:`moecomm.AllToAll` (shapes and dtypes as there): JAX on GPUs over a GPU
    transport, JAX's CPU backend over the host transport.

    Args:
        a2a: the moecomm.AllToAll (padded layout); its calls keep their rules (a dispatch, then its combine;
            collective).
        zero_slots: expert slots past their count start as zeros (XLA zeroes out_expert_x before each
            dispatch), as they always do when dispatch's inputs are differentiated. Otherwise they are
            unspecified (uninitialised memory, possibly NaN): set it when the experts' weights are
            differentiated with every slot read and dispatch's inputs are not (a first layer's tokens, with
            router weights given at combine), or mask the slots past the count.
        failed: what combine returns on GPUs, on every rank, for a call that failed (an error
            :meth:`check` raises: bad routing, a bound_m out of range, a capacity exceeded, a rank that failed or
            was not heard from): ``"nan"``, every row NaN, so that a loss or a logit shows it even where nothing
            calls :meth:`check`; or ``"zeros"``. The next call is right either way. (On the host transport the
            jitted call raises instead.)
    """

    def __init__(self, a2a, zero_slots=False, failed="nan"):
        self.a2a, c = a2a, a2a.cfg
        self._zero = bool(zero_slots)
        if failed not in ("nan", "zeros"):
            raise InvalidArgument(f"moecomm.jax.AllToAll: failed must be 'nan' or 'zeros', got {failed!r}")
        self._nan_failed = failed == "nan"
        if c.layout != "padded":
            raise InvalidArgument(f"moecomm.jax takes AllToAlls of the padded layout, not {c.layout!r}")
        self._host = a2a.comm.transport.memory == "host"
        self._device = a2a.comm.device
        expert = jax.ShapeDtypeStruct(c.expert_x_shape(), c.expert_dtype)
        scale = jax.ShapeDtypeStruct(c.expert_x_scale_shape(), c.scale_dtype) if c.hidden_dim_scale else None
        self._dispatch_out = (jax.ShapeDtypeStruct((c.num_local_experts,), np.int32), expert, scale)
        self._scaled = scale is not None  # out_expert_x_scale; dp_x_scale too but with a dispatch_wire
        self._scales_in = self._scaled and c.dispatch_wire is None
        self._plan = RoutingPlan(*(jax.ShapeDtypeStruct(s, np.int32) for s in a2a.plan_shapes()))
        self._weights_sent = False  # whether the last dispatch traced here was given router weights
        self._number = next(_numbers)  # its operations' attribute names it to the handlers
        self._uncaptured = 0  # handler runs on GPUs outside XLA's command buffers since its last recording
        self._runs = 0  # handler runs of this layer's operations, counted from its creation
        _layers[self._number] = self

    @property
    def handler_runs(self):
        """How often the handlers of this layer's operations have run (Python per call): XLA runs a handler
        when it records the call into a command buffer (its first executions, and where the buffers' addresses
        changed) and wherever it runs the call outside one (the host transport, a step XLA runs op by op). In
        a jitted step replayed from XLA's command buffers it stays the same from one step to the next."""
        return self._runs

    def check(self):
        """Raise the error the GPU recorded in this AllToAll's calls that nothing has raised yet (calls replayed
        from XLA's command buffers run no Python: see the module doc); call it once a step's outputs are
        ready (``jax.block_until_ready``). :meth:`moecomm.AllToAll.check`."""
        self.a2a.check()

    # the operations: an FFI call each, served by the handlers below -------------------------------
    def _call(self, kind, flags, results, operands, aliases, like):
        """The FFI call ``moecomm_<kind>`` with ``flags`` on ``operands`` (arrays; absent ones left out: the
        flags say which), returning a tuple of ``results`` (ShapeDtypeStructs), typed as varying where ``like``
        (the call's per-rank data: tokens, expert outputs, gradients) varies (:func:`_typed`); ``aliases``:
        operand -> result."""
        call = jax.ffi.ffi_call(_jax_internals.PREFIX + kind, _typed(results, like), has_side_effect=False,
                                input_output_aliases=aliases)
        op = np.int64(self._number << 8 | flags)
        if flags & _PLAN:  # a differentiated forward: its outputs reach the backward pass through moecomm_keep
            return _fenced(lambda *a: self._keep_op(call(*a, op=op)), *operands)
        return _fenced(lambda *a: call(*a, op=op), *operands)

    def _keep_op(self, arrays):
        """``arrays`` (a forward's outputs) through ``moecomm_keep``: its results alias its operands, and it
        copies an operand to its result where XLA gave them different buffers (see the module doc)."""
        types = [_typed([jax.ShapeDtypeStruct(a.shape, a.dtype)], a)[0] for a in arrays]
        call = jax.ffi.ffi_call(_jax_internals.PREFIX + "keep", types, has_side_effect=False,
                                input_output_aliases={i: i for i in range(len(arrays))})
        return call(*arrays, op=np.int64(self._number << 8))

    def _dispatch_op(self, send, recv, inputs, outputs=None, plan=False):
        """The given halves of dispatch on ``inputs`` (dp_x, dp_x_scale, indices, bound_m, weights, tags,
        call_id); a
        receive half after a send half completes ``outputs`` (the send's counts, expert_x, expert_x_scale) in
        place. Returns (counts, expert_x, expert_x_scale or None), and with ``plan`` the dispatch's
        RoutingPlan and expert slots past their count zero (the outputs start as zeros: a gradient of the
        experts' weights reads every slot)."""
        _unbatched(*inputs)
        structs = self._dispatch_out if self._scaled else self._dispatch_out[:2]
        start = (outputs[:len(structs)] if outputs is not None else
                 [jax.numpy.zeros(t.shape, t.dtype) for t in structs] if plan or self._zero else ())
        flags = (send * _SEND | recv * _RECV | plan * _PLAN | bool(start) * _START | (outputs is not None) * _MOVED
                 | (inputs[4] is not None) * _WEIGHTS | (inputs[5] is not None) * _TAGS
                 | (inputs[6] is not None) * _CALL_ID)
        results = structs + (tuple(self._plan) if plan else ())
        out = self._call("dispatch", flags, results, (*start, *(a for a in inputs if a is not None)),
                         {i: i for i in range(len(start))} or None, like=inputs[0])
        out = tuple(out) if self._scaled else (*out[:2], None, *out[2:])
        return (out[:3], RoutingPlan(*out[3:])) if plan else out

    def _combine_op(self, send, recv, inputs, out_tokens=None, plan=False):
        """The given halves of combine on ``inputs`` (indices, weights, expert_y, bound_m), writing into
        ``out_tokens`` (a send half's, for its receive half), else into a new result whose rows >= m the
        kernels write as zeros (CombineArgs.zero_tail: no uninitialised memory reaches JAX, and no zeros are
        copied in first), or, where the router weights have fewer rows than the indices (the kernels' rows),
        into zeros. With ``plan``, returns (out_tokens, the RoutingPlan of the dispatch it combines)."""
        _unbatched(*inputs)
        c = self.a2a.cfg
        shape = (inputs[0].shape[0], c.hidden_dim)
        if out_tokens is None and inputs[1] is not None and inputs[1].shape[0] < shape[0]:
            out_tokens = jax.numpy.zeros(shape, c.out_dtype)
        start = () if out_tokens is None else (out_tokens,)
        flags = (send * _SEND | recv * _RECV | plan * _PLAN | bool(start) * _START
                 | (inputs[1] is not None) * _WEIGHTS)
        structs = jax.ShapeDtypeStruct(shape, c.out_dtype)
        out = self._call("combine", flags, (structs, *(self._plan if plan else ())),
                         (*start, *(a for a in inputs if a is not None)), {0: 0} if start else None, like=inputs[2])
        return (out[0], RoutingPlan(*out[1:])) if plan else out[0]

    def _dispatch_backward_op(self, plan, grad_expert_x, bound_m, shape, dtype):
        """:meth:`moecomm.AllToAll.dispatch_backward` as a JAX operation: grad_x [rows, hidden] ``dtype``
        (rows >= m zero)."""
        return self._call("dispatch_backward", 0, (jax.ShapeDtypeStruct(shape, dtype),),
                          (jax.numpy.zeros(shape, dtype), *plan, grad_expert_x, bound_m), {0: 0},
                          like=grad_expert_x)[0]

    def _combine_backward_op(self, plan, grad_out, weights, expert_y, bound_m):
        """:meth:`moecomm.AllToAll.combine_backward` as a JAX operation: (grad_expert_y in expert_y's shape
        and dtype, zeros in empty slots; grad_weights [rows, k] float32, rows >= m zero)."""
        structs = (jax.ShapeDtypeStruct(expert_y.shape, expert_y.dtype),
                   jax.ShapeDtypeStruct(weights.shape, np.float32))
        return self._call("combine_backward", 0, structs, (*(jax.numpy.zeros(t.shape, t.dtype) for t in structs),
                                                           *plan, grad_out, weights, expert_y, bound_m), {0: 0, 1: 1},
                          like=grad_out)

    # the handlers (moecomm/_xla_ffi.py calls them with the frame's buffers: (address, shape, dtype)) ------
    def _array(self, b):
        """An XLA buffer as moecomm reads it: a DeviceBuffer on GPUs (XLA's memory on this rank's device), a
        numpy view on the host transport."""
        ptr, shape, dtype = b
        return host_array(ptr, shape, dtype) if self._host else DeviceBuffer(ptr, shape, dtype, self._device)

    def _scope(self, frame):
        """(XLA's stream or None on the host, the context the call runs in): on GPUs
        moecomm.AllToAll.captured(), recording where XLA is recording a command buffer. XLA may record one
        half of a call and run the other directly, so no call keeps its order on the host; XLA's data
        dependencies order them, the kernels pair them."""
        self._runs += 1
        if self._host:
            return None, contextlib.nullcontext()
        stream = _xla_ffi.stream(frame)
        recording = _cuda.is_capturing(stream)
        self._count_run(recording)
        return stream, self.a2a.captured(recording=recording)

    def _count_run(self, recording):
        """Count a handler run outside XLA's command buffers (a recording starts the count again); at
        UNCAPTURED_WARNING in a row, warn (again only after another recording)."""
        self._uncaptured = 0 if recording else self._uncaptured + 1
        if self._uncaptured == UNCAPTURED_WARNING:
            warnings.warn(f"moecomm.jax: XLA has run this AllToAll's calls {UNCAPTURED_WARNING} times outside its "
                          "command buffers, with Python per call: a jitted step of fewer commands "
                          "than xla_gpu_graph_min_graph_size runs op by op; set "
                          "XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 before JAX starts, or jit more of the step "
                          "together", RuntimeWarning, stacklevel=2)

    def _dispatch(self, flags, ins, outs, frame):
        stream, scope = self._scope(frame)
        arrays = [self._array(b) for b in ins[(2 + self._scaled) * bool(flags & _START):]]
        x, xs = arrays.pop(0), arrays.pop(0) if self._scales_in else None
        call_id = arrays.pop() if flags & _CALL_ID else None
        tags = arrays.pop() if flags & _TAGS else None
        w = arrays.pop() if flags & _WEIGHTS else None
        idx, m = arrays
        n, ex, *rest = (self._array(b) for b in outs)
        exs = rest.pop(0) if self._scaled else None
        with scope:  # after a send half, XLA may have copied its outputs: they hold what the send wrote
            self.a2a.run(DispatchArgs(n, ex, exs, x, xs, idx, m, w, None, tags, call_id, stream,
                                      bool(flags & _MOVED)),
                         flags & _SEND, flags & _RECV)
            if rest:
                self.a2a.plan(RoutingPlan(*rest), stream)

    def _combine(self, flags, ins, outs, frame):
        stream, scope = self._scope(frame)
        idx, *arrays = (self._array(b) for b in ins[bool(flags & _START):])
        w = arrays.pop(0) if flags & _WEIGHTS else None
        y, m = arrays
        out, *rest = (self._array(b) for b in outs)
        with scope:
            if rest:
                self.a2a.plan(RoutingPlan(*rest), stream)
            self.a2a.run(CombineArgs(out, idx, w, y, m, stream=stream, zero_tail=True, nan_failed=self._nan_failed),
                         flags & _SEND, flags & _RECV)

    def _keep(self, flags, ins, outs, frame):
        self._runs += 1
        for (src, shape, dtype), (dst, _, _) in zip(ins, outs):
            if src != dst:  # XLA gave the result a buffer of its own (a fused copy of this call)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if self._host:
                    ctypes.memmove(dst, src, nbytes)
                else:
                    _cuda.copy_async(dst, src, nbytes, _xla_ffi.stream(frame))

    def _dispatch_backward(self, flags, ins, outs, frame):
        stream, scope = self._scope(frame)
        *plan, g, m = (self._array(b) for b in ins[1:])
        with scope:
            self.a2a.dispatch_backward(self._array(outs[0]), RoutingPlan(*plan), g, m, stream)

    def _combine_backward(self, flags, ins, outs, frame):
        stream, scope = self._scope(frame)
        *plan, g, w, y, m = (self._array(b) for b in ins[2:])
        grad_y, grad_w = (self._array(b) for b in outs)
        with scope:
            self.a2a.combine_backward(grad_y, grad_w, RoutingPlan(*plan), g, w, y, m, stream)

    # the API ----------------------------------------------------------------------------------
    def dispatch(self, dp_x, dp_x_scale, indices, bound_m, weights=None, tags=None, call_id=None):
        """Both halves of :meth:`moecomm.AllToAll.dispatch` (``tags``: [rows] int32, each token's tag, with the
        AllToAll's num_tags; ``call_id``: [1] int32, the program's number of the call, equal on every rank; or
        None). Returns ``(out_expert_num_tokens [L] int32, out_expert_x [L, capacity,
        hidden] in_dtype (float8_e4m3fn with a dispatch_wire), out_expert_x_scale (its shape) scale_dtype or
        None)``. Differentiable (``jax.grad``,
        ``jax.vjp``; where ``a2a.gradients``): the gradient of dp_x is the sum of its slots' gradients
        (:meth:`moecomm.AllToAll.dispatch_backward`, along the dispatch's routing plan, kept as a residual);
        dp_x_scale, indices, bound_m, tags and call_id get none, and router weights given here get theirs through the
        combine that uses them. Not for FP8 dp_x (a JAX cotangent has the primal's dtype)."""
        self._weights_sent = weights is not None
        shape = (dp_x.shape[0], self.a2a.cfg.hidden_dim)
        return self._dispatch_vjp(shape, dp_x.dtype)(dp_x, dp_x_scale, indices, bound_m, weights, tags, call_id)

    def _dispatch_vjp(self, shape, dtype):
        """dispatch as a jax.custom_vjp function of (dp_x, dp_x_scale, indices, bound_m, weights, tags, call_id),
        dp_x of ``shape`` and ``dtype``."""
        @jax.custom_vjp
        def dispatch(*inputs):
            return self._dispatch_op(True, True, inputs)

        def forward(*inputs):
            if not self.a2a.gradients:  # before anything runs: no dispatch is left without its combine
                raise InvalidArgument(no_gradients(self.a2a.comm.transport.name))
            out, plan = self._dispatch_op(True, True, inputs, plan=True)
            return out, (plan, inputs[3])

        def backward(residuals, cotangents):
            if np.dtype(dtype).itemsize == 1:
                raise InvalidArgument("moecomm.jax: gradients of an FP8 dispatch are not taken (a JAX cotangent "
                                      "is FP8 too); dispatch bfloat16 or float16 tokens to train")
            plan, bound_m = residuals
            grad = cotangents[1]
            if grad.dtype.itemsize == 1:  # a quantising dispatch's e4m3 output: straight through to dp_x
                grad = grad.astype(np.float32)
            return (self._dispatch_backward_op(plan, grad, bound_m, shape, dtype),) + (None,) * 6

        dispatch.defvjp(forward, backward)
        return dispatch

    def dispatch_send(self, dp_x, dp_x_scale, indices, bound_m, weights=None, tags=None, call_id=None):
        """The send half of :meth:`dispatch`; returns a :class:`DispatchHandle` for :meth:`dispatch_recv`."""
        inputs = (dp_x, dp_x_scale, indices, bound_m, weights, tags, call_id)
        self._weights_sent = weights is not None
        return DispatchHandle(*self._dispatch_op(True, False, inputs), *inputs)

    def dispatch_recv(self, handle):
        """The receive half: completes the handle's outputs in place. Returns what :meth:`dispatch` does."""
        return self._dispatch_op(False, True, handle[3:], outputs=handle[:3])

    def combine(self, indices, weights, expert_y, bound_m):
        """Both halves of :meth:`moecomm.AllToAll.combine`. Returns out_tokens [rows, hidden] out_dtype
        (rows = indices.shape[0]; rows >= m are zeros). Differentiable (where ``a2a.gradients``):
        expert_y and the router weights get their gradients from :meth:`moecomm.AllToAll.combine_backward`,
        which needs the weights here. After a dispatch given router weights, pass the same weights here
        too to train: the sum still runs on the expert side, with the weights sent with the dispatch, and
        their gradient flows through this argument (weights=None then raises under differentiation)."""
        summed = weights is None or self._weights_sent  # on the expert side, with the weights sent with dispatch
        return self._combine_vjp(summed)(indices, weights, expert_y, bound_m)

    def _combine_vjp(self, summed):
        """combine as a jax.custom_vjp function of (indices, weights, expert_y, bound_m); with ``summed`` the
        forward uses the weights sent with dispatch (combine's own weights, the same, get the gradient)."""
        @jax.custom_vjp
        def combine(indices, weights, expert_y, bound_m):
            return self._combine_op(True, True, (indices, None if summed else weights, expert_y, bound_m))

        def forward(indices, weights, expert_y, bound_m):
            inputs = (indices, None if summed else weights, expert_y, bound_m)
            refusal = (no_gradients(self.a2a.comm.transport.name) if not self.a2a.gradients else
                       "moecomm.jax combine(weights=None) under differentiation: pass the router weights to combine "
                       "too (the same array given to dispatch; the forward still sums on the expert side with the "
                       "weights sent with the dispatch)" if weights is None else None)
            if refusal:  # after the combine (run eagerly, its dispatch has run), so that the call is over
                self._combine_op(True, True, inputs)
                raise InvalidArgument(refusal)
            out, plan = self._combine_op(True, True, inputs, plan=True)
            return out, (plan, weights, expert_y, bound_m)

        def backward(residuals, grad_out):
            plan, weights, expert_y, bound_m = residuals
            grad_y, grad_w = self._combine_backward_op(plan, grad_out, weights, expert_y, bound_m)
            return None, grad_w, grad_y, None

        combine.defvjp(forward, backward)
        return combine

    def combine_send(self, indices, weights, expert_y, bound_m):
        """The send half of :meth:`combine`; returns a :class:`CombineHandle` for :meth:`combine_recv`."""
        inputs = (indices, None if self._weights_sent else weights, expert_y, bound_m)  # as combine() sums
        return CombineHandle(self._combine_op(True, False, inputs), *inputs)

    def combine_recv(self, handle):
        """The receive half: returns out_tokens, as :meth:`combine`."""
        return self._combine_op(False, True, handle[1:], out_tokens=handle[0])
