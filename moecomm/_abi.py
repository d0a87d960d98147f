"""The kernel ABI, declared once: parameter structs, kernel signatures, device layouts, device constants.

Python packs kernel parameters into ctypes structures built from the field lists below, and
:func:`header` turns the same lists into ``moecomm_abi.h``, the header every ``cuda/*.cu`` file includes:
the ``MOECOMM_*`` constants, the structs with ``static_assert``s of each struct's size and each field's
size and alignment as ctypes computed them (so the offsets agree too), and a declaration of every kernel. A
``.cu`` file whose kernel signature differs from its declaration here, or a struct laid out differently by the
device compiler, fails to build; at load time :meth:`moecomm._cuda.Module.function` also checks each
kernel's parameter sizes against these structs.

The dispatch/combine kernels all take the same two parameters: ``Fixed`` (set once per AllToAll: its
layout, device state and buffers) and ``Call`` (the arrays of the current call, rewritten by every
call). A launch copies both, so one host-side copy of each serves every kernel and every call.
"""
import ctypes
from dataclasses import dataclass

from . import _constants as C

_CTYPES = {"int": ctypes.c_int32, "unsigned": ctypes.c_uint32, "unsigned long long": ctypes.c_uint64,
           "unsigned char": ctypes.c_uint8}


def _ctype(c_decl):
    """ctypes type of a C field type: every pointer is a 64-bit address, stored as an int."""
    return ctypes.c_uint64 if c_decl.endswith("*") else _CTYPES[c_decl]


def _struct(name, fields, doc):
    cls = type(name, (ctypes.Structure,), {"_fields_": [(f, _ctype(t)) for f, t in fields], "__doc__": doc})
    cls.c_fields = fields
    return cls


# The AllToAll's fixed parameters: layout (sizes in elements or bytes), then device state and buffers.
FIXED_FIELDS = (
    ("state", "unsigned*"),         # uint32 device state, MOECOMM_S_* indices
    ("err", "int*"),                # int32[MOECOMM_ERROR_WORDS] error word (mapped host memory)
    ("recv_buf", "uint8_t*"),       # symmetric [world, max_tokens, rec_bytes] dispatch records
    ("comb_buf", "uint8_t*"),       # symmetric combine rows, [max(world, topk) * max_tokens, comb_row_bytes]
    ("stage", "uint8_t*"),          # symmetric staging rows (sources of puts to unmapped peers)
    ("sig", "uint64_t*"),           # symmetric [world] dispatch signals
    ("arrive", "uint64_t*"),        # symmetric [world, max_tokens] arrival words of dispatch records (the call)
    ("comb_arrive", "uint64_t*"),   # symmetric [world, max_tokens] arrival words of combine partial sums
    ("comb_sig", "uint64_t*"),      # symmetric [world] combine signals
    ("slot_of", "int*"),            # [world, max_tokens, topk] expert slot of each received record's k-th id
    ("own_of", "int2*"),            # [max_tokens, topk] this rank's expert slot of token t's k-th id (or -1)
                                    # and its weight (float bits); written by dispatch_send at world size 1
                                    # (combine_local) and where comb_streamed
    ("ids_of", "int*"),             # [max_tokens, topk] the expert ids of this rank's tokens as its last
                                    # dispatch read them (expert_id()), which combine's must equal
    ("mask", "const int*"),         # [world] int32: 1 = rank masked (no data to or from it, no wait for it)
    ("counters", "unsigned long long*"),  # uint64 cumulative counters, MOECOMM_C_* indices, then arrays at c_*
    ("ring", "unsigned*"),          # [window, local_experts] (token, expert) pairs routed per local expert, per
                                    # call (the telemetry window; row CALLS % window)
    ("drop_buf", "uint64_t*"),      # symmetric [world, max_tokens] (overflow="drop"): (call << 32 | top-k bits
                                    # of the token's pairs that rank dropped), else null
    ("why", "uint64_t*"),           # symmetric [world]: what a rank's failed call was (capacity: expert + 1
                                    # << 32 | demand), written before the signal that flags it
    ("map", "const int*"),          # [num_experts, 1 + world] replicas of each logical expert: count, then
                                    # physical slots (rank * local_experts + slot); null without an expert map
    ("peers", "const long long*"),  # [world] the transport's peer table (MOECOMM_PEER_UNMAPPED: puts)
    ("gone", "const uint64_t*"),    # symmetric [world]: gone[q] != 0 once rank q has left (every wait reads it)
    ("tag_ring", "unsigned*"),      # [tally_rows, num_tags, local_experts]: pairs each local expert received per
                                    # tag, per call (row CALLS % tally_rows); null without tags or window
    ("gap_ring", "unsigned*"),      # [tally_rows, GAP_BINS]: this rank's tokens per router-confidence bin, per
                                    # call, rowed alike; null without score_gap or window
    ("ids", "uint64_t*"),           # symmetric [world]: (call << 32 | call_id, 0xffffffff: none) of each rank's
                                    # dispatch, written before its signal (ERR_CALL_ID)
    # gradients (AllToAll(gradients=True), else null; cuda/backward.cu):
    ("sent", "int*"),               # [max_tokens, topk] physical expert each pair of the last dispatch went to
                                    # (-1: not sent), written by dispatch_send for this rank's tokens
    ("grad_buf", "uint8_t*"),       # symmetric [world * max_tokens, grad_row_bytes] gradient rows
    ("grad_sig", "uint64_t*"),      # symmetric [3, world]: backward signals of the rows, of the router weights'
                                    # gradients, and each rank's "read" word (its buffer is free again)
    ("grad_w", "uint64_t*"),        # symmetric [max_tokens, topk]: (call << 32 | float bits) router weights'
                                    # gradients
    ("timeout_ns", "unsigned long long"),
    ("world", "int"), ("rank", "int"), ("dp", "int"), ("num_experts", "int"), ("local_experts", "int"),
    ("topk", "int"), ("max_tokens", "int"), ("hidden", "int"),
    ("x_bytes", "int"),             # hidden * expert dtype size: a token row as it travels and lands
    ("quant", "int"),               # MOECOMM_QUANT_*: the send side quantises rows of src_code (dispatch_wire)
    ("src_code", "int"),            # with quant: MOECOMM_DT_BF16 / FP16 of c.x
    ("src_row_bytes", "int"),       # with quant: hidden * 2, a row of c.x
    ("scale_bytes", "int"),         # a token's scales in bytes (0 without scales)
    ("scale_item", "int"),          # bytes of one scale: 4 (float32, int32 of four UE8M0) or 1 (UE8M0)
    ("scale_column", "int"),        # 1: out_scale column-major per expert ([L, scales, cap]; packed [scales, cap])
    ("meta_off", "int"),            # offset of a record's metadata (token, ids[topk], weights[topk])
    ("rec_bytes", "int"),           # bytes of one dispatch record
    ("out_code", "int"),            # MOECOMM_DT_BF16 / MOECOMM_DT_FP16
    ("out_row_bytes", "int"),       # hidden * out_dtype size
    ("wire", "int"),                # combine's rows on the wire: MOECOMM_WIRE_* (0: out_dtype)
    ("comb_row_bytes", "int"),      # bytes of one combine row on the wire (combine_row_bytes)
    ("cap", "int"),                 # slots per local expert (packed layout: rows of the rank)
    ("drop", "int"),                # 1: overflow="drop", 0: "error"
    ("packed", "int"),              # MOECOMM_PACK_*: rows placed once counted, grouped by source (gpu_plan.pack)
    ("window", "int"),              # rows of ring
    ("c_received", "int"), ("c_dropped", "int"), ("c_bytes", "int"),  # counters[] offsets of the arrays
    ("stage_slots", "int"), ("stage_bytes", "int"),  # staging rows per block and their size
    ("s_expert", "int"), ("s_recv", "int"),          # state[] offsets of per-expert and per-source counters
    ("s_kept", "int"),              # state[] offset of kept pairs per (source, local expert), then each one's
                                    # first row in its expert (packed)
    ("s_claim", "int"),             # state[] offset of per-source claimed records (dispatch_recv)
    ("s_combined", "int"),          # state[] offset of the call each combine_local block last combined
    ("senders", "int"),             # blocks of the one-launch dispatch that send (dispatch_senders)
    ("streamed", "int"),            # 1: the one-launch dispatch unpacks records as they land (streamed)
    ("comb_streamed", "int"),       # 1: the one-launch combine with partial sums streams (combine_streams)
    ("grad_row_bytes", "int"),      # bytes of a gradient row (grad_row_bytes)
    ("num_tags", "int"),            # tags a token's tag may be below (0: tags are not counted)
    ("tally_rows", "int"),          # rows of tag_ring and gap_ring: the least power of two above window
)
# The arrays of one call (dispatch fields, then combine fields): device addresses, 0 for None.
CALL_FIELDS = (
    ("x", "const uint8_t*"),        # dispatch: [rows, hidden] in_dtype (quant: src_code)
    ("x_scale", "const uint8_t*"),  # dispatch: [rows, scales] scale_dtype
    ("indices", "const void*"),     # [rows, topk] int32/uint32 (idx64 == 0) or int64 expert ids
    ("weights", "const float*"),    # [rows, topk] float32; the ranks layout's combine (no router weights there):
                                    # its expert_weights [cap, topk] float32 side rows (the record stays 128 bytes)
    ("bound_m", "const int*"),      # [1] int32/uint32: m
    ("out_num", "int*"),            # dispatch: [local_experts] int32
    ("out_x", "uint8_t*"),          # dispatch: [local_experts, cap, hidden] expert dtype
    ("out_scale", "uint8_t*"),      # dispatch: [local_experts, cap, scales] scale_dtype (scale_column: transposed)
    ("out_offsets", "int*"),        # dispatch, packed layout: [local_experts + 1] int32
    # combine's three below; a dispatch given sources in the local path's small-batch kernel (gpu_plan.py:
    # dispatch_sources; cuda/local.cu call_sources) carries them here: src_info, layout_range, add_counts (Sources)
    ("y", "const uint8_t*"),        # combine: [local_experts, cap, hidden] out_dtype
    ("out_tokens", "uint8_t*"),     # combine: [rows, hidden] out_dtype
    ("out_dropped", "uint8_t*"),    # combine: [rows, topk] uint8, 1: the pair was dropped for capacity; the ranks
                                    # layout (nothing dropped): its out_weights [rows, topk] float32
    ("tags", "const int*"),         # dispatch: [rows] int32 each token's tag (AllToAll num_tags), or null
    ("call_id", "const int*"),      # dispatch: [1] int32 the program's number of the call, or null
    ("rows", "int"),                # rows of x / out_tokens / indices / weights
    ("reason", "int"),              # with skip: the reason flagged to the peers (0: none), see _constants
    # flags in bytes: the record stays within 128 bytes (136 slowed the default path: benchmarks/NOTES.md)
    ("idx64", "unsigned char"),     # indices are int64
    ("partials", "unsigned char"),  # combine: weights came with dispatch (sum on the expert side)
    ("skip", "unsigned char"),      # 1: this rank takes part with no data (its call was refused); arrays 0
    ("zero_tail", "unsigned char"),  # combine: rows m..rows-1 of out_tokens get zeros too (all rows when m fails)
    ("nan_failed", "unsigned char"),  # combine: every row of out_tokens is NaN where the call failed (fill_rows)
)
# The arrays of one backward call or plan (cuda/backward.cu): device addresses, 0 for None.
GRAD_FIELDS = (
    ("expert", "int*"),             # plan.expert [max_tokens, topk] int32
    ("origin", "int*"),             # plan.origin [slots, 3] int32 (source rank, token, k)
    ("call", "int*"),               # plan.call [2] int32 (generation, dispatch call)
    ("held", "int*"),               # plan.held [1 + slots] int32: n, then the n slots that hold a pair
    ("local", "int*"),              # plan.local [max_tokens, topk] int32: the slot of each pair on this rank
    ("bound_m", "const int*"),      # [1] int32: m
    ("grad", "const uint8_t*"),     # dispatch_backward: grad_expert_x [slots, hidden]; combine_backward:
                                    # grad_out [rows, hidden]; grad_code
    ("out", "uint8_t*"),            # dispatch_backward: out_grad_x [rows, hidden]; combine_backward:
                                    # out_grad_expert_y [slots, hidden]; out_code
    ("out_w", "float*"),            # combine_backward: out_grad_weights [rows, topk] float32
    ("weights", "const float*"),    # combine_backward: [rows, topk] float32 router weights
    ("y", "const uint8_t*"),        # combine_backward: expert_y [slots, hidden] out_dtype
    ("rows", "int"),                # the fewest rows of the call's per-token arrays
    ("slots", "int"),               # expert slots (padded: local_experts * cap; packed: rows)
    ("grad_code", "int"), ("out_code", "int"),  # MOECOMM_DT_* of grad and out
    ("generation", "int"),          # plan(): the AllToAll's restart generation
    ("skip", "int"),                # 1: this rank takes part with no data (its call was refused)
    ("reason", "int"),              # with skip: the reason flagged to the peers
)
PEER_CHECK_FIELDS = (
    ("inbox", "uint8_t*"),          # symmetric [2, world, row_bytes]: check c reads half c % 2
    ("outbox", "const uint8_t*"),   # symmetric [>= nbytes]: this rank's pattern
    ("signals", "uint64_t*"),       # symmetric [world]: checks whose data from each peer has landed
    ("err", "int*"),
    ("peers", "const long long*"),  # [world] the transport's peer table
    ("gone", "const uint64_t*"),    # symmetric [world]: gone[q] != 0 once rank q has left
    ("expected", "unsigned long long"), ("nbytes", "unsigned long long"),
    ("row_bytes", "unsigned long long"), ("timeout_ns", "unsigned long long"),
    ("rank", "int"), ("world", "int"),
)
DELAY_FIELDS = (("ns", "unsigned long long"),)
SOURCES_FIELDS = (  # AllToAll.source_layout (moecomm_source_layout, cuda/backward.cu)
    ("src_info", "int*"),           # [local_experts * cap] int32: each slot's token, -1 where empty
    ("layout_range", "long long*"),  # [local_experts, world] int64: (first slot << 32) | slots of each source
    ("add_counts", "int*"),         # [local_experts] int32 or null: each expert's slots written added to it
)
ROW_ROUTING_FIELDS = (  # AllToAll.row_routing in the ranks layout (moecomm_row_routing, cuda/backward.cu)
    ("indices", "void*"),           # [cap, topk] int32 (idx64 0) or int64: each row's local expert ids, -1 elsewhere
    ("weights", "float*"),          # [cap, topk] float32 or null: the dispatched weights there, 0 elsewhere
    ("idx64", "int"),
)
HALF_FIELDS = (("recv", "int"),)  # a kernel that runs either half of a phase (cuda/deep_ep.cu): 1 the receive half

Fixed = _struct("Fixed", FIXED_FIELDS, "Parameters fixed for one AllToAll (see FIXED_FIELDS).")
Call = _struct("Call", CALL_FIELDS, "Arrays of one dispatch or combine call (see CALL_FIELDS).")
Grad = _struct("Grad", GRAD_FIELDS, "Arrays of one backward call or plan (see GRAD_FIELDS).")
PeerCheck = _struct("PeerCheck", PEER_CHECK_FIELDS, "Parameters of one peer check.")
Delay = _struct("Delay", DELAY_FIELDS, "Parameters of the benchmark's device delay.")
Half = _struct("Half", HALF_FIELDS, "Which half a kernel of both halves runs.")
Sources = _struct("Sources", SOURCES_FIELDS, "Outputs of AllToAll.source_layout (see SOURCES_FIELDS).")
RowRouting = _struct("RowRouting", ROW_ROUTING_FIELDS, "Outputs of AllToAll.row_routing (see ROW_ROUTING_FIELDS).")
STRUCTS = (Fixed, Call, Grad, PeerCheck, Delay, Half, Sources, RowRouting)


# Layouts of device memory the kernels index ---------------------------------------------------------
class Layout(dict):
    """{array name: its first index} of arrays laid out one after the other; ``size``: the words in all."""

    def __init__(self, start, arrays):
        super().__init__()
        for name, n in arrays:
            self[name] = start
            start += n
        self.size = start


def state_layout(cfg, combine_local_blocks):
    """The arrays after the STATE_FIELDS words of an AllToAll's uint32 device state (Fixed.s_<name>):
    records sent per destination rank, pairs per local expert (its demand), records received per source,
    pairs kept per (source, local expert) and then the first row of each in its expert (rows placed by
    the receive half's place_rows: gpu_plan.pack), records claimed per source (streamed dispatch_recv), the
    ranks layout's bitmap of the tokens received from each source ([world, max_tokens / 32 rounded up]: a row's
    place within its source), the call each block of moecomm_combine_local last combined (its grid:
    ``combine_local_blocks``, 0 where the AllToAll does not launch it)."""
    W, L = cfg.world_size, cfg.num_local_experts
    present = W * -(-cfg.max_num_tokens // 32) if cfg.layout == "ranks" else 0
    return Layout(C.STATE_FIXED, (("send", W), ("expert", L), ("recv", W), ("kept", 2 * W * L), ("claim", W),
                                  ("present", present), ("combined", combine_local_blocks)))


def counter_layout(cfg):
    """The arrays after the COUNTER_FIELDS of an AllToAll's uint64 device counters (Fixed.c_<name>): tokens
    received and pairs dropped per local expert, bytes per peer [BYTE_FIELDS, world]."""
    W, L = cfg.world_size, cfg.num_local_experts
    return Layout(len(C.COUNTER_FIELDS), (("received", L), ("dropped", L), ("bytes", len(C.BYTE_FIELDS) * W)))


def _align16(n):
    return (n + 15) // 16 * 16


def combine_row_bytes(cfg):
    """Bytes of one combine row as it travels: hidden_dim values of out_dtype, or on an FP8 combine wire
    hidden_dim e4m3 bytes then a scale per COMBINE_BLOCK values (float32, or one UE8M0 byte), padded to 16. In the
    ranks layout the row's float32 side row follows (top-k values, from the 16-byte boundary: side_row())."""
    H = cfg.hidden_dim
    if cfg.layout == "ranks":
        return _align16(H * cfg.out_dtype.itemsize) + _align16(4 * cfg.experts_per_token)
    if cfg.combine_wire is None:
        return H * cfg.out_dtype.itemsize
    return _align16(H + H // C.COMBINE_BLOCK * (1 if cfg.combine_wire == "e4m3_ue8m0" else 4))


def grad_row_bytes(cfg):
    """Bytes of one gradient row (cuda/backward.cu): hidden_dim float32 values at most (a row travels in its
    gradient's dtype), the token's router weights (float32 [topk], 16-byte aligned), then a 16-byte trailer
    (the backward call, the row's dtype code)."""
    return 4 * cfg.hidden_dim + _align16(4 * cfg.experts_per_token) + 16


@dataclass(frozen=True)
class RecordLayout:
    """One dispatch record, in bytes: the token row (x_bytes), its scales at ``scale_off`` (scale_bytes), then
    at ``meta_off`` int32 token, int32 expert ids [topk], float32 weights [topk], int32 tag (with tags);
    ``size`` in all, each part 16-byte aligned (the tag always fits in the metadata's padding)."""
    x_bytes: int
    scale_off: int
    scale_bytes: int
    meta_off: int
    size: int

    @classmethod
    def of(cls, cfg):
        x = cfg.hidden_dim * cfg.expert_dtype.itemsize  # the token as it travels
        scales = 0 if cfg.hidden_dim_scale is None else cfg.hidden_dim_scale * cfg.scale_dtype.itemsize
        meta = _align16(x) + _align16(scales)
        return cls(x, _align16(x), scales, meta, meta + _align16(8 + 8 * cfg.experts_per_token))


# Kernel signatures ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kernel:
    """One kernel's declaration: its symbol, its parameters (struct types, in order), its block size, and
    whether it is a programmatic dependent launch where the GPU has them (``dependent``; compute capability
    from ``PROGRAMMATIC_ARCH``): it may then be launched while the stream's previous kernel runs, and its
    first statement is ``after_previous_kernel()`` (cuda/device.cuh), which waits for that kernel's end.
    Which kernels an AllToAll runs, and their grids: moecomm/transport/gpu_plan.py.

    ``cxx``: the C++ kernel (``namespace::name``, parameters in namespace moecomm) this entry launches where it
    is not the ``extern "C"`` kernel ``name`` (DeepEP's profiler names, cuda/deep_ep.cu); several entries may
    launch one, each with its own ``half`` (its Half parameter). ``symbol``: the name the module has."""
    name: str
    params: tuple
    threads: int = C.BLOCK_THREADS
    dependent: bool = True
    cxx: str = ""
    half: int = 0

    @property
    def symbol(self):
        """``name``, or ``cxx`` mangled (Itanium C++ ABI: nested names, each parameter a struct of namespace
        moecomm, which is the first substitution S_)."""
        if not self.cxx:
            return self.name
        parts = self.cxx.split("::")
        assert parts[0] == "moecomm", self.cxx
        return ("_ZN" + "".join(f"{len(p)}{p}" for p in parts) + "E"
                + "".join(f"NS_{len(t.__name__)}{t.__name__}E" for t in self.params))


KERNELS = {k.name: k for k in (
    *(Kernel(name, (Fixed, Call)) for name in (
        "moecomm_dispatch_send", "moecomm_dispatch_recv", "moecomm_combine_send",
        "moecomm_combine_recv", "moecomm_dispatch", "moecomm_dispatch_streamed", "moecomm_combine",
        "moecomm_combine_send_wire", "moecomm_combine_recv_wire", "moecomm_combine_wire", "moecomm_dispatch_local",
        "moecomm_dispatch_tokens", "moecomm_combine_local")),
    *(Kernel(name, (Fixed, Grad)) for name in ("moecomm_plan", "moecomm_dispatch_backward",
                                                "moecomm_combine_backward", "moecomm_dispatch_backward_local",
                                                "moecomm_combine_backward_local")),
    Kernel("moecomm_source_layout", (Fixed, Sources)),
    Kernel("moecomm_row_routing", (Fixed, RowRouting)),
    *(Kernel(f"moecomm_deep_ep_{phase}_{half}", (Fixed, Call, Half), cxx=f"moecomm::deep_ep::{phase}",
             half=int(half == "recv")) for phase in ("dispatch", "combine") for half in ("send", "recv")),
    Kernel("moecomm_peer_check", (PeerCheck,), threads=32, dependent=False),
    Kernel("moecomm_delay", (Delay,), threads=1, dependent=False),
)}


# The device header --------------------------------------------------------------------------------
HEADER_NAME = "moecomm_abi.h"


def header():
    """The text of ``moecomm_abi.h`` (handed to NVRTC in memory; the build-cache key covers it)."""
    lines = ["// Generated by moecomm/_abi.py (constants, kernel parameter structs, kernel declarations).",
             "#pragma once", "#include <cuda/std/cstdint>", ""]
    lines += [f"#define MOECOMM_{k} {v}" for k, v in sorted(C.device_constants().items())]
    lines += ["", "namespace moecomm {"]
    for s in STRUCTS:
        lines.append(f"struct {s.__name__} {{")
        lines += [f"  {t} {f};" for f, t in s.c_fields]
        lines.append("};")
        lines.append(f'static_assert(sizeof({s.__name__}) == {ctypes.sizeof(s)}, "{s.__name__}: size differs '
                     f'from moecomm/_abi.py");')
        for f, _ in s.c_fields:  # same order, sizes and alignments: the same offsets as ctypes computed
            t = _ctype(dict(s.c_fields)[f])
            lines.append(f"static_assert(sizeof(decltype({s.__name__}::{f})) == {ctypes.sizeof(t)} && "
                         f"alignof(decltype({s.__name__}::{f})) == {ctypes.alignment(t)}, "
                         f'"{s.__name__}.{f}: size or alignment differs from moecomm/_abi.py");')
    lines += ["}  // namespace moecomm", ""]
    for cxx, k in {k.cxx or k.name: k for k in KERNELS.values()}.items():
        params = ", ".join(f"const moecomm::{p.__name__}" for p in k.params)
        if k.cxx:
            space, name = cxx.rsplit("::", 1)
            lines.append(f"namespace {space} {{ __global__ void {name}({params}); }}")
        else:
            lines.append(f'extern "C" __global__ void {k.name}({params});')
    return "\n".join(lines) + "\n"

