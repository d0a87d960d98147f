"""Constants shared by Python and device code.

Defined once here; :func:`device_constants` hands them to :mod:`moecomm._abi`, which writes them into
the generated device header (``MOECOMM_<NAME>``), so the build-cache key covers them and no ``.cu`` file
repeats a number.
"""
import os

from ._errors import InvalidArgument

# Device error word (int32[6]): code, peer rank, phase, detail, call (the AllToAll's call number, from 1),
# amount (a count that goes with detail: a demand).
# The first error wins, except that a timeout replaces any other (it breaks the communicator).
ERR_NONE = 0
ERR_TIMEOUT = 1       # a bounded wait expired; peer = rank waited for; detail TIMEOUT_LEFT: that rank left
TIMEOUT_LEFT = 1      # (the detail of ERR_TIMEOUT) the rank waited for has left the job (its gone word is set)
ERR_BAD_EXPERT = 2    # an expert id outside [-1, num_experts) or repeated in a token (-1: no expert);
                      # peer = this rank, detail = token index
ERR_BAD_M = 3         # bound_m outside [0, min(rows, max_num_tokens)]; detail = m, amount = that bound
ERR_OVERFLOW = 4      # more records or expert slots than the buffers hold (a peer broke the protocol)
ERR_M_DIFFERS = 5     # combine's bound_m differs from the dispatched m; detail = combine's m
ERR_PEER = 6          # rank `peer` flagged its part of the call as failed; detail = its reason (below)
ERR_REFUSED = 7       # (in a reason only) AllToAll refused an argument on that rank
ERR_CAPACITY = 8      # overflow="error": a local expert (detail: its id) got more pairs (amount) than its
                      # capacity; packed layout: detail -1, the rank's rows
ERR_GENERATION = 9    # a peer's dispatch carried another expert-map generation; detail = its generation
ERR_ENDED = 10        # (in a reason only) that rank ended the call part-way after an error of it (synchronize)
ERR_PLAN_DIFFERS = 11  # a backward call: rank `peer` follows the routing plan of another dispatch (detail: its
                       # plan's call, amount: this rank's; ((generation mod 128) << 24 | call mod 2**24)), or
                       # (detail -1) sent no gradient for a pair this rank's plan holds (amount: the slot)
ERR_PLAN_M = 12       # a backward call: the plan has pairs for tokens >= bound_m (detail = m): another call's plan
ERR_IDS_DIFFER = 13   # combine was given other expert ids than its dispatch (this rank's; flagged to the peers as a
                      # refused "indices")
ERR_ORDER = 15        # a dispatch began before the previous call's combine ran on this rank's GPU, or a combine
                      # with no dispatch of its own before it (calls replayed from a graph with no host order: an
                      # operation run twice, or a combine before its dispatch)
ERR_WEIGHTS_DIFFER = 14  # rank `peer`'s combine was given router weights and this rank's not, or the reverse
                         # (detail: 1 where that rank's combine was given them)
ERR_BAD_TAG = 16      # a token's tag outside [0, num_tags); detail = token index, amount = the tag (flagged to the
                      # peers as a refused "tags")
ERR_CALL_ID = 17      # rank `peer`'s dispatch carried another call_id than this rank's (detail: its id, amount: this
                      # rank's; -1: none given): a rank skipped or repeated a call of the program
ERROR_WORDS = 6
# A rank whose part of a call failed still takes part ("no data") and flags its signals with a reason:
# an ERR_* code, and for ERR_REFUSED the refused argument's number in ARGUMENTS shifted by REASON_ARG_SHIFT
# (for ERR_CAPACITY the expert id + 1, 0 for the packed layout's rank budget; the demand travels beside it).
REASON_ARG_SHIFT = 8
ARGUMENTS = ("the order of calls", "out_expert_num_tokens", "out_expert_x", "out_expert_x_scale", "dp_x",
             "dp_x_scale", "indices", "bound_m", "weights", "out_tokens", "expert_y", "stream", "do_send",
             "do_recv", "out_dropped", "out_expert_offsets", "plan", "plan.expert", "plan.origin", "plan.call",
             "out_grad_x", "grad_expert_x", "out_grad_expert_y", "out_grad_weights", "grad_out", "tags", "call_id",
             "expert_weights", "out_weights", "sources", "out_src_info", "out_layout_range", "add_counts")

# The reason a combine's signals carry when its expert ids differ from its dispatch's: a refused "indices".
REASON_IDS_DIFFER = ERR_REFUSED | ARGUMENTS.index("indices") << REASON_ARG_SHIFT
# The reason a dispatch's signals carry when a token's tag is out of range: a refused "tags".
REASON_BAD_TAG = ERR_REFUSED | ARGUMENTS.index("tags") << REASON_ARG_SHIFT

# Tags (AllToAll num_tags): at most this many; a token's tag is in [0, num_tags).
MAX_TAGS = 256
# Router confidence (AllToAll score_gap): a token's gap between its largest and its smallest router weight (over its
# pairs with an expert id; tokens with two or more) falls in bin i when GAP_EDGES[i] <= gap < GAP_EDGES[i + 1]
# (float32 compares; the last bin has no upper edge). Bin 0 is the near-tie bin: below 0.01 the choice between the
# token's experts turns on the last bits of the router's output (a rounding difference flips it).
GAP_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
GAP_BINS = len(GAP_EDGES)

# dtype codes of expert outputs and gradients in device code
DT_BF16, DT_FP16, DT_FP32 = 0, 1, 2

# Device state of one AllToAll (uint32): per-half epochs (calls completed; combine_recv waits for the call combine_send
# ends) and block counters, the reason this rank's dispatch send failed (0: none), the dispatched m, the reason its
# receive half failed (capacity: the combine flags it to the peers) and its detail (the demand), the expert-map
# generation (set by set_expert_map, carried by every dispatch signal), the packed layout's row counter, then the arrays
# of moecomm._abi.state_layout (their offsets depend on the sizes). TOKENS_EVEN / TOKENS_ODD: tokens the streamed
# combine_recv has claimed in even / odd calls (each combine_send zeroes the next call's).
# The backward calls (cuda/backward.cu): EPOCH_B counts them (both kinds), DONE_B0 .. DONE_B2 are their kernels' block
# counters (one per part: a block may be in the next part before the last one has finished this one), BAD_B the reason
# this rank's part failed (its signals flag it).
STATE_FIELDS = ("EPOCH_DS", "EPOCH_DR", "EPOCH_CS", "DONE_DS", "DONE_DR", "DONE_CS", "BAD", "M", "BAD_RECV", "WHY",
                "GEN", "ROWS", "TOKENS_EVEN", "TOKENS_ODD", "EPOCH_B", "DONE_B0", "DONE_B1", "DONE_B2",
                "BAD_B")
STATE_FIXED = len(STATE_FIELDS)
STAGE_SLOTS = 4       # staging rows per block for puts to peers without a load/store mapping
KERNEL_NAMES = ("moecomm", "deep_ep")  # AllToAll(kernel_names=): the split halves' own kernels, or DeepEP's names
BLOCK_THREADS = 256   # threads of every alltoall block: a block handles one token or record at a time
BLOCKS_PER_SM = 2     # alltoall blocks resident per SM (kernels are built for it: 128 registers per thread)
MAX_GRID_BLOCKS = 1 << 16  # every grid is smaller (launch plans check it): a block count's high bits carry a flag
PROGRAMMATIC_ARCH = 900  # compute capability (as __CUDA_ARCH__: 100 * major + 10 * minor) from which moecomm's
                         # kernels are programmatic dependent launches (Hopper; moecomm/_abi.py: Kernel.dependent)
SUM_SLICE_CHUNKS = 64  # 16-byte chunks of a token's row per work item of the local path's combine, at least
                       # (cuda/local.cu: combine_local; a small batch's rows cut so, to fill the grid)
SEND_SHARE = 64       # percent of a one-launch dispatch grid that sends (the rest unpacks records as they land)
STREAM_TOKENS = 8     # the one-launch phases stream where a block of the send share holds more tokens than
                      # this (moecomm/_abi.py, streamed; below, claiming rows one by one costs more than it gains)
ARRIVAL_BATCH = 4     # rows a sending block stores per fence that releases their arrival words, at most
ARRIVAL_FIRST = 1     # rows of a sending block's first release; each next release covers twice as many, up to
                      # ARRIVAL_BATCH (the receivers start early, the fences stay few; cuda/alltoall.cuh)
# Cumulative uint64 counters of one AllToAll, kept on the device (AllToAll.stats()), then the arrays of
# moecomm._abi.counter_layout: tokens received and pairs dropped per local expert [L], bytes per peer
# [BYTE_FIELDS, world].
COUNTER_FIELDS = ("MASKED_PAIRS",     # (token, expert) pairs not sent because the expert's rank is masked
                  "DROPPED_PAIRS",    # pairs routed to this rank's experts past their capacity (overflow="drop")
                  "OVERFLOW_PAIRS",   # the same under overflow="error" (those calls raised CapacityExceeded)
                  "CALLS")            # dispatches whose receive half ran with data (the telemetry window's clock)
BYTE_FIELDS = ("dispatch_sent", "dispatch_received", "combine_sent", "combine_received")
# The replica rule of expert maps (moecomm.balance.ExpertMap.physical, and the kernels): replica
# (token * REPLICA_TOKEN + dp_group * REPLICA_GROUP) mod 2**32 mod replicas.
REPLICA_TOKEN, REPLICA_GROUP = 2654435761, 40503
# Per-call routing counts kept for the telemetry window (AllToAll(telemetry_window=...)).
DEFAULT_WINDOW = 64
# A dispatch signal's low 32 bits: the record count in the low COUNT_BITS, the expert-map generation
# modulo 2**GEN_BITS above them (bit 31 flags a failed call, whose reason replaces both).
SIG_COUNT_BITS, SIG_GEN_BITS = 24, 7

PHASES = ("peer_check", "dispatch", "combine", "dispatch_backward", "combine_backward")
# The phases of a call, each with its own call record (moecomm.transport.base).
CALL_PHASES = ("dispatch", "combine")
# The four halves of a call, in the order every rank issues them (moecomm._calls.CallOrder).
HALVES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
PHASE_PEER_CHECK, PHASE_DISPATCH, PHASE_COMBINE, PHASE_DISPATCH_BACKWARD, PHASE_COMBINE_BACKWARD = range(len(PHASES))
# A plan's call in the backward kernels' signals: (generation mod 2**PLAN_GEN_BITS) << PLAN_CALL_BITS |
# dispatch call mod 2**PLAN_CALL_BITS.
PLAN_CALL_BITS, PLAN_GEN_BITS = 24, 7

# Bounded waits. Default in seconds, overridable per object and by one environment variable.
DEFAULT_TIMEOUT_S = 10.0
TIMEOUT_ENV = "MOECOMM_TIMEOUT_S"

# Largest supported routing configuration (device code sizes per-token arrays with these).
MAX_TOPK = 16
MAX_EXPERTS = 512

# A GPU transport's peer table holds, per rank, the offset from this rank's symmetric memory to that rank's
# copy of it as mapped here; PEER_UNMAPPED marks a rank with no load/store mapping (another node: reached
# by puts). Real offsets are multiples of the heap alignment, so 1 is never one.
PEER_UNMAPPED = 1
# Bytes of the ipc transport's symmetric heap per rank, unless $MOECOMM_IPC_HEAP_MB says otherwise.
IPC_HEAP_BYTES = 4 << 30
IPC_HEAP_ENV = "MOECOMM_IPC_HEAP_MB"

# Largest peer check (Communicator.check_peers); its buffers are allocated at init.
PEER_CHECK_BYTES = 1 << 16

# Alignment of one token row in bytes (kernels copy rows with 16-byte vector accesses).
ROW_ALIGN = 16
# A token's scales are copied in 4-byte words: a scale row is a multiple of this many bytes.
SCALE_ALIGN = 4
# Values per float32 (or UE8M0) scale of an FP8 combine wire, and the largest e4m3 value a scale maps to.
COMBINE_BLOCK, E4M3_MAX = 128, 448.0
# combine_wire as the kernels know it (Fixed.wire): None (rows in out_dtype), "e4m3", "e4m3_ue8m0".
WIRE_NONE, WIRE_E4M3, WIRE_E4M3_UE8M0 = 0, 1, 2
WIRE_CODES = {None: WIRE_NONE, "e4m3": WIRE_E4M3, "e4m3_ue8m0": WIRE_E4M3_UE8M0}
# A quantising dispatch (dispatch_wire) as the kernels know it (Fixed.quant): none, e4m3 with float32 scales,
# with power-of-two float32 scales, with UE8M0 bytes (float8_e8m0fnu, or four per int32).
QUANT_NONE, QUANT_FLOAT, QUANT_POW2, QUANT_UE8M0 = 0, 1, 2, 3
# Where the dispatch receive half's rows go (Fixed.packed): in place as each record lands (the padded layout);
# or placed once every count is known (the receive half's last stage, cuda/dispatch_recv.cu's place_rows), each
# expert's rows grouped by source rank in rank order: back to back for the rank (the packed layout), or from each
# expert's first slot (the padded layout with group_by_source at world size > 1); or a row per received record,
# sources in rank order, each source's in token order (the ranks layout).
PACK_NONE, PACK_LAYOUT, PACK_BY_SOURCE, PACK_RANKS = 0, 1, 2, 3


def timeout_seconds(value=None):
    """Resolve a timeout: the argument, else ``$MOECOMM_TIMEOUT_S``, else the default.

    Returns ``(seconds, source)`` where source says where the value came from (for logs and errors).
    """
    if value is not None:
        raw, source = value, "argument"
    elif os.environ.get(TIMEOUT_ENV):
        raw, source = os.environ[TIMEOUT_ENV], TIMEOUT_ENV
    else:
        raw, source = DEFAULT_TIMEOUT_S, "default"
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise InvalidArgument(f"timeout must be a number of seconds > 0, got {raw!r} (from {source})")
    return seconds, source


# Build option: MOECOMM_FORCE_PUTS=1 makes kernels send every byte with NVSHMEM puts, as to a peer on
# another node, instead of stores through nvshmem_ptr (for testing that path on one node).
FORCE_PUTS_ENV = "MOECOMM_FORCE_PUTS"
# Build option: MOECOMM_TRACE=1 makes the kernels stamp the SM clock at the end of each stage of each half
# (tools/trace_kernels.py reads and names them): TRACE_POINTS stamps per half, the last one the duration of
# the last block's signals and counters; and TRACE_SPAN words per kernel (indexed by the half it starts with):
# global-timer first/last block entry, first/last block exit, block 0's SM clock and global timer at entry
# and exit.
TRACE_ENV = "MOECOMM_TRACE"
TRACE_POINTS = 8
TRACE_SPAN = 8


# Exported to device code as MOECOMM_<name> (moecomm/_abi.py writes them into the generated moecomm_abi.h):
# every ERR_*, PHASE_*, DT_*, WIRE_*, QUANT_* and PACK_* constant above, these scalars, these literals (with their C
# suffixes), the build options and the indices of the field tables (S_*, C_*, B_*, TRACE_<half>).
_DEVICE_SCALARS = ("TIMEOUT_LEFT", "REASON_IDS_DIFFER", "REASON_BAD_TAG", "GAP_BINS", "ERROR_WORDS",
                   "REASON_ARG_SHIFT", "SIG_COUNT_BITS",
                   "SIG_GEN_BITS", "MAX_TOPK", "MAX_EXPERTS", "ROW_ALIGN", "BLOCK_THREADS", "BLOCKS_PER_SM",
                   "MAX_GRID_BLOCKS",
                   "ARRIVAL_BATCH", "ARRIVAL_FIRST", "TRACE_POINTS", "TRACE_SPAN", "COMBINE_BLOCK", "PLAN_CALL_BITS",
                   "PLAN_GEN_BITS", "PROGRAMMATIC_ARCH", "SUM_SLICE_CHUNKS")
_DEVICE_LITERALS = {"REPLICA_TOKEN": "u", "REPLICA_GROUP": "u", "PEER_UNMAPPED": "ll", "E4M3_MAX": "f"}


def device_constants():
    """The constants above (and the build options from the environment) by device name (MOECOMM_<name>)."""
    names = globals()
    values = {n: v for n, v in names.items()
              if n.startswith(("ERR_", "PHASE_", "DT_", "WIRE_", "QUANT_", "PACK_")) and isinstance(v, int)}
    values.update({n: names[n] for n in _DEVICE_SCALARS})
    values.update({n: f"{names[n]}{suffix}" for n, suffix in _DEVICE_LITERALS.items()})
    values.update(GAP_EDGES="{" + ", ".join(f"{e!r}f" for e in GAP_EDGES) + "}")  # an initializer list
    values.update(FORCE_PUTS=int(os.environ.get(FORCE_PUTS_ENV, "0") == "1"),
                  TRACE=int(os.environ.get(TRACE_ENV, "0") == "1"), TRACE_HALVES=len(HALVES), S_FIXED=STATE_FIXED)
    values.update({f"S_{name}": i for i, name in enumerate(STATE_FIELDS)})
    values.update({f"C_{name}": i for i, name in enumerate(COUNTER_FIELDS)})
    values.update({f"B_{name.upper()}": i for i, name in enumerate(BYTE_FIELDS)})
    values.update({f"TRACE_{name.upper()}": i for i, name in enumerate(HALVES)})
    return values


def m_in_range(m, rows, max_tokens):
    """The bound_m rule: a call's m is in [0, rows] (the fewest rows of its per-token arrays) and at most
    ``max_tokens`` (max_num_tokens). The kernels follow it too (cuda/alltoall.cuh, ``m_in_range``; a test
    evaluates that one against this); moecomm.reference gives it too."""
    return 0 <= m <= rows and m <= max_tokens
