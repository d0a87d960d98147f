"""PyTorch: dispatch and combine as autograd operations over tensors as they are.

    import moecomm, moecomm.torch
    comm = moecomm.init()
    layer = moecomm.torch.AllToAll(moecomm.AllToAll(comm, ...))
    counts, expert_x, expert_x_scale = layer.dispatch(dp_x, dp_x_scale, indices, bound_m, weights)
    out_tokens = layer.combine(indices, weights, expert_y, bound_m)
    out_tokens.float().pow(2).sum().backward()      # gradients of dp_x, the experts and the router weights

The outputs are allocated here, on the tensors' device (CPU tensors on the host transport, CUDA tensors on a
GPU transport), and moecomm writes them. When autograd records (grad mode on and an input requires grad),
each operation also keeps its routing plan (:class:`moecomm.RoutingPlan`) for its backward:
:meth:`moecomm.AllToAll.dispatch_backward` gives dp_x its gradient (the sum of its slots'), and
:meth:`moecomm.AllToAll.combine_backward` gives expert_y and the router weights theirs. The backward follows
the forward's placement whatever ran between them (other layers on the same AllToAll included). Gradients
are computed where ``a2a.gradients`` is True: the host transport, and GPU transports whose AllToAll was
constructed with ``gradients=True`` (without it they refuse them; inference runs anywhere).

Router weights: given to dispatch, pass the same tensor to combine too when training: the weighted sum still
runs on the expert side with the weights sent with the dispatch, and their gradient flows through combine's
argument (combine with weights=None then refuses to record a backward). FP8 tokens get no gradient (a
gradient has its tensor's dtype; differentiate the bfloat16 tokens before quantising). The core package
never imports torch; this module does.
"""
import functools

import numpy as np
import torch

from ._arrays import DeviceBuffer, _torch_dtype, torch_function_off
from ._dtypes import bfloat16, float8_e4m3fn, float8_e8m0fnu
from ._errors import InvalidArgument
from .alltoall import CombineArgs, RoutingPlan, no_gradients

_RAW = {torch.bfloat16: (torch.int16, bfloat16), torch.float8_e4m3fn: (torch.uint8, float8_e4m3fn)}
_TORCH = {np.dtype(bfloat16): torch.bfloat16, np.dtype(float8_e4m3fn): torch.float8_e4m3fn,
          np.dtype(float8_e8m0fnu): torch.uint8,  # UE8M0 scales as their bytes (moecomm reads uint8 as UE8M0)
          np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32,
          np.dtype(np.uint8): torch.uint8}


def plain_torch(fn):
    """``fn`` with torch's ``__torch_function__`` handling off while it runs: a program under a torch function mode
    (``torch.set_default_device``, which DeepEP's tests and some engines set) otherwise sends every tensor method
    moecomm calls through that mode, ~1 µs each, and a call makes dozens (reading each array's address, shape,
    dtype, layout and device). moecomm's calls name the device and dtype of every tensor they make."""
    @functools.wraps(fn)
    def plain(*args, **kwargs):
        with torch_function_off():
            return fn(*args, **kwargs)
    return plain


class AllToAll:
    """Autograd operations over a :class:`moecomm.AllToAll` (shapes and dtypes as there; its call rules hold:
    a dispatch, then its combine; collective).

    Args:
        a2a: the moecomm.AllToAll (padded or packed layout).
    """

    def __init__(self, a2a):
        self.a2a = a2a
        self._host = a2a.comm.transport.memory == "host"
        self._weights_sent = False  # whether the last dispatch was given router weights
        self._plan_shapes = a2a.plan_shapes()
        self.offsets = None  # packed layout: the last dispatch's out_expert_offsets [L + 1] int32

    def _arg(self, t):
        """A tensor as moecomm reads it: itself on GPUs; a numpy view of its memory on the host transport."""
        if t is None or not self._host:
            return t
        if t.dtype in _RAW:
            raw, dtype = _RAW[t.dtype]
            return t.detach().view(raw).numpy().view(dtype)
        return t.detach().numpy()

    def _kept(self, t):
        """A contiguous tensor the caller keeps across calls and never resizes (its own output buffers) as moecomm
        reads it at no cost per call: a DeviceBuffer over its memory (holding the tensor) on GPUs; :meth:`_arg`'s
        view on the host transport."""
        if t is None or self._host:
            return self._arg(t)
        return DeviceBuffer(t.data_ptr(), t.shape, _torch_dtype(t.dtype), t.get_device(), t)

    def _stream(self, like):
        """The launch stream of a call whose arrays are on ``like``'s device: torch's current stream there (a
        handle, so that arrays given as DeviceBuffers (:meth:`_kept`) do not imply CuPy's); None on the host."""
        return None if self._host else torch._C._cuda_getCurrentRawStream(like.get_device())

    def _new(self, shape, dtype, like, zeros):
        maker = torch.zeros if zeros else torch.empty
        return maker(tuple(shape), dtype=_TORCH[np.dtype(dtype)], device=like.device)

    def _plan(self, like):
        """A new RoutingPlan of int32 tensors and moecomm's view of it."""
        plan = RoutingPlan(*(self._new(s, np.int32, like, False) for s in self._plan_shapes))
        return plan, RoutingPlan(*(self._arg(t) for t in plan))

    @plain_torch
    def dispatch(self, dp_x, dp_x_scale, indices, bound_m, weights=None, tags=None, call_id=None):
        """:meth:`moecomm.AllToAll.dispatch` (both halves; ``tags``: [rows] int32 with num_tags, ``call_id``:
        [1] int32 equal on every rank, or None).
        Returns ``(out_expert_num_tokens [L] int32,
        out_expert_x in_dtype (float8_e4m3fn with a dispatch_wire), out_expert_x_scale scale_dtype (UE8M0 as
        uint8) or None)`` (packed layout:
        out_expert_offsets is :attr:`offsets` after the call). Expert slots past their count are zero in grad
        mode (a memset of out_expert_x; run inference under ``torch.no_grad()`` or ``torch.inference_mode()``
        to skip it), else unspecified. dp_x's gradient: the sum of its slots' gradients."""
        self._weights_sent = weights is not None
        return _Dispatch.apply(self, torch.is_grad_enabled(), dp_x, dp_x_scale, indices, bound_m, weights, tags,
                               call_id)

    @plain_torch
    def combine(self, indices, weights, expert_y, bound_m):
        """:meth:`moecomm.AllToAll.combine` (both halves). Returns out_tokens [rows, hidden] out_dtype (rows =
        indices.shape[0]; rows >= m are zeros). expert_y and weights get their gradients from
        :meth:`moecomm.AllToAll.combine_backward`; after a dispatch given weights, pass the same weights here
        to train (see the module's doc)."""
        summed = weights is None or self._weights_sent
        return _Combine.apply(self, indices, weights, expert_y, bound_m, summed)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, training, dp_x, dp_x_scale, indices, bound_m, weights, tags, call_id):
        a2a, c, arg = layer.a2a, layer.a2a.cfg, layer._arg
        keep = ctx.needs_input_grad[2]
        if keep and not a2a.gradients:  # before anything runs: no dispatch is left without its combine
            raise InvalidArgument(no_gradients(a2a.comm.transport.name))
        n = layer._new((c.num_local_experts,), np.int32, dp_x, False)
        # slots past their count zero in grad mode: a gradient of the experts' weights reads every slot
        ex = layer._new(c.expert_x_shape(), c.expert_dtype, dp_x, training)
        exs = None if c.hidden_dim_scale is None else layer._new(c.expert_x_scale_shape(), c.scale_dtype, dp_x,
                                                                 training)
        layer.offsets = (layer._new((c.num_local_experts + 1,), np.int32, dp_x, False) if c.layout == "packed"
                         else None)
        a2a.dispatch(arg(n), arg(ex), arg(exs), arg(dp_x), arg(dp_x_scale), arg(indices), arg(bound_m),
                     weights=arg(weights), out_expert_offsets=arg(layer.offsets), tags=arg(tags),
                     call_id=arg(call_id))
        ctx.mark_non_differentiable(n)
        ctx.layer, ctx.rows, ctx.dtype = layer, dp_x.shape[0], dp_x.dtype
        if keep:
            plan, view = layer._plan(dp_x)
            a2a.plan(view)
            ctx.save_for_backward(*plan, bound_m)
        return n, ex, exs

    @staticmethod
    @plain_torch
    def backward(ctx, _counts, grad_expert_x, _grad_scale):
        layer = ctx.layer
        if not ctx.needs_input_grad[2]:  # only the weights required grad: theirs flows through combine
            return (None,) * 9
        if ctx.dtype == torch.float8_e4m3fn:
            raise InvalidArgument("moecomm.torch: FP8 tokens get no gradient (it would be FP8 too); differentiate "
                                  "the bfloat16 tokens before quantising")
        *plan, bound_m = ctx.saved_tensors
        grad_x = torch.zeros((ctx.rows, layer.a2a.cfg.hidden_dim), dtype=ctx.dtype, device=grad_expert_x.device)
        if grad_expert_x.element_size() == 1:  # a quantising dispatch's e4m3 output: straight through to dp_x
            grad_expert_x = grad_expert_x.float()
        layer.a2a.dispatch_backward(layer._arg(grad_x), RoutingPlan(*map(layer._arg, plan)),
                                    layer._arg(grad_expert_x.contiguous()), layer._arg(bound_m))
        return None, None, grad_x, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, indices, weights, expert_y, bound_m, summed):
        a2a, c, arg = layer.a2a, layer.a2a.cfg, layer._arg
        keep = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        refusal = None  # raised after the combine has run, so that the call is over and the next one works
        if keep and not a2a.gradients:
            refusal = no_gradients(a2a.comm.transport.name)
        elif keep and weights is None:
            refusal = ("moecomm.torch combine(weights=None) with autograd recording: pass the router weights to "
                       "combine too (the same tensor given to dispatch; the forward still sums on the expert side "
                       "with the weights sent with the dispatch)")
        keep = keep and refusal is None
        if keep:
            plan, view = layer._plan(expert_y)
            a2a.plan(view)  # the plan of the dispatch this combine ends
        # rows >= m: written as zeros by the kernels (zero_tail), or zeros first where the router weights have
        # fewer rows than the indices (the kernels' rows)
        short = not summed and weights.shape[0] < indices.shape[0]
        out = layer._new((indices.shape[0], c.hidden_dim), c.out_dtype, expert_y, short)
        a2a.run(CombineArgs(arg(out), arg(indices), None if summed else arg(weights), arg(expert_y), arg(bound_m),
                            zero_tail=True))
        if refusal:
            raise InvalidArgument(refusal)
        if keep:
            ctx.layer = layer
            ctx.save_for_backward(*plan, weights, expert_y, bound_m)
        return out

    @staticmethod
    @plain_torch
    def backward(ctx, grad_out):
        layer, arg = ctx.layer, ctx.layer._arg
        *plan, weights, expert_y, bound_m = ctx.saved_tensors
        grad_y, grad_w = torch.zeros_like(expert_y), torch.zeros_like(weights)  # empty slots: zero
        layer.a2a.combine_backward(arg(grad_y), arg(grad_w), RoutingPlan(*map(arg, plan)),
                                   arg(grad_out.contiguous()), arg(weights), arg(expert_y), arg(bound_m))
        return None, None, grad_w, grad_y, None, None
