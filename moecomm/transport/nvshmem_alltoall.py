"""AllToAll on GPUs: the four kernels of ``cuda/`` over NVSHMEM symmetric buffers sized once.

Symmetric memory per rank (bytes), W ranks, M = max_num_tokens, K = top-k, H = hidden_dim:

    dispatch records   W * M * R          R = align16(H * in_size) + align16(4 * scales) + align16(4 + 8K)
    combine rows       max(W, K) * M * H * out_size
    staging            blocks * 4 * max(R, H * out_size)   (sources of puts to non-mapped peers)
    signals            2 * W * 8

(:func:`symmetric_bytes`). Bytes on the wire per call, for n tokens sent by a rank and reaching on
average r distinct other ranks: dispatch n * r * R (a token's rows for this rank's own experts are
stored in place by the send kernel, with no record); combine n * r * H * out_size with router weights at
dispatch (one partial per token and expert rank), else n * K * H * out_size.

No host synchronization happens in dispatch or combine: m is read on the device from ``bound_m``, epochs
and counters live in device memory, errors land in a mapped host word that is checked at the next call
and by :meth:`synchronize`.
"""
import numpy as np

from .. import _constants as C
from .._dtypes import float16
from .base import AllToAllBackend
from .nvshmem import error_from_words


def _align16(n):
    return (n + 15) // 16 * 16


def record_bytes(cfg):
    """Bytes of one dispatch record: token row, scales, token index + expert ids + weights."""
    scales = 0 if cfg.hidden_dim_scale is None else 4 * cfg.hidden_dim_scale
    return (_align16(cfg.hidden_dim * cfg.in_dtype.itemsize) + _align16(scales)
            + _align16(4 + 8 * cfg.experts_per_token))


def grids(cfg, num_sms):
    """Blocks for (dispatch_send, per-source kernels, combine_recv): a block per token or record, up to
    two blocks per SM (the kernels are built for two resident blocks; no block waits for another of its
    own grid, so blocks beyond what is resident just queue)."""
    most = 2 * num_sms
    send_blocks = max(1, min(most, -(-cfg.max_num_tokens // cfg.dp_size)))
    parts = max(1, min(cfg.max_num_tokens, most // cfg.world_size))
    recv_blocks = max(1, min(most, cfg.max_num_tokens))
    return send_blocks, cfg.world_size * parts, recv_blocks


def symmetric_sizes(cfg, num_sms):
    """Bytes of each symmetric buffer one rank allocates (the formula in the module doc), and the staging
    row size: {"recv_buf", "comb_buf", "stage", "signals", "stage_row"}."""
    W, M, K = cfg.world_size, cfg.max_num_tokens, cfg.experts_per_token
    out_row = cfg.hidden_dim * cfg.out_dtype.itemsize
    send_blocks, per_src, _ = grids(cfg, num_sms)
    stage_row = max(record_bytes(cfg), out_row)
    stage_rows = max(send_blocks, per_src) * C.STAGE_SLOTS
    return dict(recv_buf=W * M * record_bytes(cfg), comb_buf=max(W, K) * M * out_row,
                stage=stage_rows * stage_row, signals=2 * W * 8, stage_row=stage_row)


def symmetric_bytes(cfg, num_sms=132):
    """Symmetric memory one rank allocates for this configuration (132 SMs: an H100/H200)."""
    sizes = symmetric_sizes(cfg, num_sms)
    return sum(v for k, v in sizes.items() if k != "stage_row")


class NvshmemAllToAll(AllToAllBackend):
    def __init__(self, transport, cfg, timeout_s):
        import cupy
        self.t, self.cfg, self._cupy = transport, cfg, cupy
        self.timeout_ns = np.uint64(int(timeout_s * 1e9))
        W, M, K, L = cfg.world_size, cfg.max_num_tokens, cfg.experts_per_token, cfg.num_local_experts
        out_row = cfg.hidden_dim * cfg.out_dtype.itemsize
        rec = record_bytes(cfg)
        num_sms = cupy.cuda.Device(transport.device).attributes["MultiProcessorCount"]
        self.send_blocks, self.per_src_blocks, self.recv_blocks = grids(cfg, num_sms)
        sizes = symmetric_sizes(cfg, num_sms)
        layout = dict(
            WORLD=W, RANK=cfg.rank, DP=cfg.dp_size, EXPERTS=cfg.num_experts, LOCAL_EXPERTS=L, TOPK=K,
            MAX_TOKENS=M, HIDDEN=cfg.hidden_dim, X_BYTES=cfg.hidden_dim * cfg.in_dtype.itemsize,
            SCALE_BYTES=0 if cfg.hidden_dim_scale is None else 4 * cfg.hidden_dim_scale,
            META_OFF=rec - _align16(4 + 8 * K), REC_BYTES=rec,
            OUT_CODE=C.DT_FP16 if cfg.out_dtype == float16 else C.DT_BF16,
            OUT_ROW_BYTES=out_row, CAP=cfg.expert_capacity, STAGE_SLOTS=C.STAGE_SLOTS, STAGE_BYTES=sizes["stage_row"])
        self.layout = cupy.asarray(np.array([layout[f] for f in C.LAYOUT_FIELDS], np.int64))
        self.state = cupy.zeros(C.STATE_FIXED + 2 * W + L, np.uint32)
        self.slot_of = cupy.empty(W * M * K, np.int32)
        sym = transport.symmetric
        self.recv_buf = sym((sizes["recv_buf"],), np.uint8)
        self.comb_buf = sym((sizes["comb_buf"],), np.uint8)
        self.stage = sym((sizes["stage"],), np.uint8)
        self.sig = sym((2, W), np.uint64)  # [0]: dispatch signals, [1]: combine signals
        self._owned = [self.recv_buf, self.comb_buf, self.stage, self.sig]
        self.sig.fill(0)
        mem = cupy.cuda.PinnedMemoryPointer(
            cupy.cuda.PinnedMemory(4 * C.ERROR_WORDS, cupy.cuda.runtime.hostAllocMapped), 0)
        self._err_mem, self.err = mem, np.frombuffer(mem, np.int32, C.ERROR_WORDS)
        self.err[:] = 0
        cupy.cuda.get_current_stream().synchronize()
        transport.barrier()
        cupy.cuda.get_current_stream().synchronize()
        self._f = {n: transport.function(f"moecomm_{n}") for n in
                   ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")}

    # ------------------------------------------------------------------------------------------
    def _launch(self, name, blocks, stream, *args):
        self._f[name]((blocks,), (C.BLOCK_THREADS,), (self.layout, self.state, np.uint64(self._err_mem.ptr), *args),
                      stream=self._cupy.cuda.ExternalStream(stream))

    @staticmethod
    def _ptr(buf):
        return np.uint64(0 if buf is None else buf.ptr)

    def check_error(self):
        """Raise the first error a kernel recorded (no synchronization), and clear it."""
        if self.err[0] != C.ERR_NONE:
            words = self.err.copy()
            self.err[:] = 0
            raise error_from_words(words, "AllToAll")

    def synchronize(self, stream):
        self._cupy.cuda.ExternalStream(stream).synchronize()
        self.check_error()

    # ------------------------------------------------------------------------------------------
    def dispatch(self, a, do_send, do_recv, stream):
        self.check_error()
        if do_send:
            self._launch("dispatch_send", self.send_blocks, stream, self._ptr(a.dp_x), self._ptr(a.dp_x_scale),
                         self._ptr(a.indices), self._ptr(a.weights), self._ptr(a.bound_m),
                         np.int32(a.dp_x.shape[0]), self.recv_buf, self.sig[0], self.stage,
                         self._ptr(a.out_expert_x), self._ptr(a.out_expert_x_scale), self.slot_of)
        if do_recv:
            self._launch("dispatch_recv", self.per_src_blocks, stream, self.recv_buf, self.sig[0],
                         self._ptr(a.out_expert_num_tokens), self._ptr(a.out_expert_x),
                         self._ptr(a.out_expert_x_scale), self.slot_of, self.timeout_ns)

    def combine(self, a, do_send, do_recv, stream):
        self.check_error()
        partials = np.int32(a.weights is None)
        if do_send:
            self._launch("combine_send", self.per_src_blocks, stream, self.recv_buf, self.slot_of,
                         self._ptr(a.expert_y), partials, self.comb_buf, self.sig[1], self.stage)
        if do_recv:
            self._launch("combine_recv", self.recv_blocks, stream, self.comb_buf, self.sig[1],
                         self._ptr(a.indices), self._ptr(a.weights), self._ptr(a.bound_m),
                         np.int32(a.out_tokens.shape[0]), partials, self._ptr(a.out_tokens), self.timeout_ns)

    def destroy(self):
        self._cupy.cuda.get_current_stream().synchronize()
        self.t.barrier()
        self._cupy.cuda.get_current_stream().synchronize()
        for a in self._owned:
            self.t.free(a)
        self._owned = []

