"""The launch plan of a GPU AllToAll, decided in one place: which module its kernels come from, which
kernels each half runs and with how many blocks, whether a phase runs in one launch, whether batches stream.
:func:`launch_plan` maps (configuration, GPU SMs, transport variant, whether every peer is mapped) to a frozen
:class:`LaunchPlan`; the backend (gpu_alltoall.py) only executes it, and ``a2a.stats()["plan"]`` reports it.

The rules, each beside its reason:

* **SM budget** (:func:`sm_budget`): grids are sized for the GPU's SMs, or ``max_sms`` of them.
* **Grids** (:data:`GRIDS`): up to BLOCKS_PER_SM blocks per SM (the kernels' launch bounds make that many
  resident); a send half has a block per token of the rank's DP share, a receive half a block per
  (source rank, record), the token side a block per token, the local path's combine a block per (token, slice
  of its row).
* **One launch or two**: a phase whose two halves are requested together runs as one kernel
  (:data:`WHOLE_KERNELS`), whose blocks wait for each other's signals, so its grid must be resident at once;
  where it is not (more ranks than BLOCKS_PER_SM * SMs) the phase runs its halves' kernels back to back and
  ``LaunchPlan.fallback`` says so.
* **Streaming** (:func:`streamed`): at prefill-sized batches dispatch records carry arrival words and part of
  the one-launch dispatch unpacks them as they land (its own kernel, ``moecomm_dispatch_streamed``); the
  one-launch combine streams its partial sums too where :func:`combine_streams` says so.
* **The local path** (:func:`local`): at world size 1 in the padded layout (cuda/local.cu; the backward
  operations' local kernels in cuda/backward.cu).
* **The module**: the transport's own build, or at prefill-sized batches in a group whose every peer is mapped
  its put-free twin (:data:`PUT_FREE_TWIN`).
* **FP8 combine wire**: the combine kernels of the wire (names ending ``_wire``), so the out-dtype kernels carry
  none of its code.
"""
from dataclasses import dataclass

from .. import _constants as C
from .. import _jit

# Kernel names (declared in moecomm._abi.KERNELS, defined in cuda/*.cu) -----------------------------------
HALF_KERNELS = tuple(f"moecomm_{half}" for half in C.HALVES)  # the four halves' kernels, in HALVES' order
DEEP_EP_HALVES = tuple(f"moecomm_deep_ep_{half}" for half in C.HALVES)  # kernel_names="deep_ep" (deep_ep.cu)
WHOLE_KERNELS = {"dispatch": "moecomm_dispatch", "combine": "moecomm_combine"}  # a phase's halves in one launch
STREAMED_DISPATCH = "moecomm_dispatch_streamed"  # the one-launch dispatch of streamed batches (cuda/dispatch.cu)
LOCAL_KERNELS = {"dispatch": "moecomm_dispatch_local", "combine": "moecomm_combine_local"}  # local() (cuda/local.cu)
LOCAL_TOKENS = "moecomm_dispatch_tokens"  # the local path's dispatch where every token has a block (local.cu)
WIRE = "_wire"  # the combine kernels of an FP8 combine wire: their names end so (cuda/combine*.cu)
WIRE_KERNELS = ("moecomm_combine_send_wire", "moecomm_combine_recv_wire", "moecomm_combine_wire")
GRAD_KERNELS = {"plan": "moecomm_plan", "dispatch_backward": "moecomm_dispatch_backward",
                "combine_backward": "moecomm_combine_backward"}  # {operation: its kernel} (backward.cu)
SOURCE_LAYOUT = "moecomm_source_layout"  # AllToAll.source_layout, where the slots are grouped by source (backward.cu)
ROW_ROUTING = "moecomm_row_routing"  # AllToAll.row_routing, in the ranks layout (backward.cu)
LOCAL_GRAD_KERNELS = {"dispatch_backward": "moecomm_dispatch_backward_local",
                      "combine_backward": "moecomm_combine_backward_local"}  # local() (backward.cu)

# A variant whose kernels a group with every peer mapped runs at prefill-sized batches instead of its own: the
# same sources without the put path, whose registers and stack slow the streamed kernels (the streamed combine
# measured +9 us at R1-prefill in the nvshmem build), and with the streamed combine, which puts cannot feed
# (they carry no arrival words; benchmarks/NOTES.md, row 18).
PUT_FREE_TWIN = {"nvshmem": "ipc"}


# Grid rules: (cfg, sms) -> blocks ------------------------------------------------------------------------
def sm_budget(cfg, num_sms):
    """The SMs the grids are sized for: the GPU's ``num_sms``, or fewer where the AllToAll's ``max_sms`` caps
    them (every kernel then has at most BLOCKS_PER_SM * max_sms blocks)."""
    return num_sms if cfg.max_sms is None else min(num_sms, cfg.max_sms)


def _send_blocks(cfg, sms):
    """A block per token of this rank's DP share, up to BLOCKS_PER_SM per SM (no block of a half waits for
    another of its own grid, so blocks beyond what is resident just queue)."""
    return max(1, min(C.BLOCKS_PER_SM * sms, -(-cfg.max_num_tokens // cfg.dp_size)))


def _per_source_blocks(cfg, sms):
    """world * parts blocks: block b serves source rank b % world, a record per block (strided; dispatch_recv
    spreads them over the sources whose records it unpacks). All resident while world <= BLOCKS_PER_SM * SMs:
    a phase in one launch needs that (:func:`resident`)."""
    return cfg.world_size * max(1, min(cfg.max_num_tokens, C.BLOCKS_PER_SM * sms // cfg.world_size))


def _token_blocks(cfg, sms):
    """A block per token of the DP group (strided), up to BLOCKS_PER_SM per SM."""
    return max(1, min(C.BLOCKS_PER_SM * sms, cfg.max_num_tokens))


def _token_part_blocks(cfg, sms):
    """moecomm_dispatch_tokens (cuda/local.cu): max_num_tokens * parts blocks, each taking every parts-th pair of
    its token, so that a small batch's rows are stored from many SMs: parts up to top-k while the grid fills at
    most half of the BLOCKS_PER_SM per SM resident (each part loads the token's whole row: one H200 measured two
    parts per token 0.2 µs slower than one at 128 tokens, eight 0.5 µs faster at 16); 1 where pairs may be
    dropped for capacity (a token's drop word is one block's)."""
    room = C.BLOCKS_PER_SM * sms // (2 * cfg.max_num_tokens)
    return cfg.max_num_tokens * (1 if cfg.drops else max(1, min(cfg.experts_per_token, room)))


def _sum_blocks(cfg, sms):
    """moecomm_combine_local (cuda/local.cu): a block per (token, slice of SUM_SLICE_CHUNKS 16-byte chunks of its
    row) work item, up to BLOCKS_PER_SM per SM (the kernel cuts a row into as many slices as the grid has room
    for, up to that)."""
    slices = -(-(cfg.hidden_dim // 8) // C.SUM_SLICE_CHUNKS)
    return max(1, min(C.BLOCKS_PER_SM * sms, cfg.max_num_tokens * slices))


def _pair_blocks(cfg, sms):
    """moecomm_combine_backward_local (cuda/backward.cu): a block per (token, part of its pairs) work item, up to
    BLOCKS_PER_SM per SM (the kernel cuts a token's pairs into as many parts as the grid has room for, up to
    top-k)."""
    return max(1, min(C.BLOCKS_PER_SM * sms, cfg.max_num_tokens * cfg.experts_per_token))


def _one_block(cfg, sms):
    """moecomm_source_layout (cuda/backward.cu): one block, which counts each source's slots in every expert."""
    return 1


def _resident_blocks(cfg, sms):
    """BLOCKS_PER_SM per SM, the blocks resident at once: the backward kernels (cuda/backward.cu), each
    operation in one launch whose parts wait for each other's signals."""
    return C.BLOCKS_PER_SM * sms


GRIDS = {  # every dispatch/combine kernel's grid rule
    "moecomm_dispatch_send": _send_blocks,
    "moecomm_dispatch_recv": _per_source_blocks,
    "moecomm_combine_send": _per_source_blocks,
    "moecomm_combine_recv": _token_blocks,
    "moecomm_dispatch": _per_source_blocks,
    "moecomm_dispatch_streamed": _per_source_blocks,
    "moecomm_combine": _per_source_blocks,
    "moecomm_combine_send_wire": _per_source_blocks,
    "moecomm_combine_recv_wire": _token_blocks,
    "moecomm_combine_wire": _per_source_blocks,
    "moecomm_dispatch_local": _send_blocks,
    "moecomm_dispatch_tokens": _token_part_blocks,
    "moecomm_combine_local": _sum_blocks,
    "moecomm_plan": _resident_blocks,
    "moecomm_dispatch_backward": _resident_blocks,
    "moecomm_combine_backward": _resident_blocks,
    "moecomm_dispatch_backward_local": _sum_blocks,
    "moecomm_combine_backward_local": _pair_blocks,
    SOURCE_LAYOUT: _one_block,
    ROW_ROUTING: _per_source_blocks,
}
GRIDS.update({d: GRIDS[h] for d, h in zip(DEEP_EP_HALVES, HALF_KERNELS)})  # DeepEP's names: their halves' grids


def resident(blocks, num_sms):
    """Whether a grid of ``blocks`` AllToAll blocks is resident at once on ``num_sms`` SMs (the kernels' launch
    bounds guarantee BLOCKS_PER_SM per SM), as a phase in one launch must be: its blocks wait for signals that
    other blocks of the same grid send."""
    return blocks <= C.BLOCKS_PER_SM * num_sms


# Selection ------------------------------------------------------------------------------------------
def _send_share(cfg, sms):
    """SEND_SHARE percent of the one-launch dispatch grid."""
    return max(1, _per_source_blocks(cfg, sms) * C.SEND_SHARE // 100)


def streamed(cfg, sms):
    """Whether a block of the send share can hold more than STREAM_TOKENS tokens (prefill-sized batches), so that
    dispatch records carry arrival words and the receive half gains by unpacking them as they land. Otherwise
    every record is covered by its source's signal only, and the receive half waits for it: claiming records
    one by one would only add a round trip to small batches. Never at world size 1 in the packed layouts
    (pack()): the one-launch dispatch's own records carry no row (place_rows reads it from x), so nothing lands
    early, and the whole grid sends."""
    if cfg.world_size == 1 and pack(cfg) != C.PACK_NONE:
        return False
    return -(-cfg.max_num_tokens // cfg.dp_size) > C.STREAM_TOKENS * _send_share(cfg, sms)


def combine_streams(cfg, sms, variant):
    """Whether the one-launch combine (with partial sums) streams: this rank's own partial sums are never
    formed, and the token side adds each token's own expert rows to the peers' partial sums as these land
    (arrival words; cuda/combine.cu). Prefill-sized batches (streamed), DP size 1, rows stored in place (pack()), and a
    module whose kernels carry it (moecomm._jit.Variant.streams_combine of ``variant``). Not on an FP8 combine
    wire: the token side would add rows of two formats."""
    return (streamed(cfg, sms) and cfg.dp_size == 1 and not pack(cfg) and cfg.combine_wire is None
            and _jit.VARIANTS[variant].streams_combine)


def dispatch_senders(cfg, sms):
    """Blocks of the one-launch dispatch grid that send: the send share where records stream (the other blocks
    unpack them from the start, while the sends keep NVLink busy), else the whole grid."""
    return _send_share(cfg, sms) if streamed(cfg, sms) else _per_source_blocks(cfg, sms)


def phase_of(name):
    """The phase ("dispatch" or "combine") of an AllToAll kernel: whose call record it reads."""
    return "combine" if name.startswith(("moecomm_combine", "moecomm_deep_ep_combine")) else "dispatch"


def _on_wire(cfg, name):
    return name + WIRE if cfg.combine_wire is not None and phase_of(name) == "combine" else name


def half_kernels(cfg):
    """The four halves' kernels for this configuration, in HALVES' order: on an FP8 combine wire the combine's
    own; with kernel_names="deep_ep" DeepEP's profiler names (one kernel per phase: DEEP_EP_HALVES), but for
    the combine on a wire."""
    names = HALF_KERNELS if cfg.kernel_names == "moecomm" else DEEP_EP_HALVES
    return tuple(n if cfg.combine_wire is None or phase_of(n) == "dispatch" else _on_wire(cfg, h)
                 for n, h in zip(names, HALF_KERNELS))


def local(cfg):
    """Whether the phases in one launch take the local path (cuda/local.cu): world size 1 in the padded layout,
    where every pair is the rank's own, so the dispatch unpacks no record, the combine forms each token's sum
    straight from its expert rows, and no block waits for another. On an FP8 combine wire only the dispatch
    does (whole_kernels): the wire's combine keeps its own kernel."""
    return cfg.world_size == 1 and cfg.layout == "padded"


def pack(cfg):
    """Where the dispatch receive half's rows go (Fixed.packed, moecomm._constants.PACK_*): placed once every count
    is known, by every block of the half's grid (resident: _per_source_blocks), grouped by source, in the packed
    layout (PACK_LAYOUT), in the padded one with group_by_source at world size > 1 (PACK_BY_SOURCE: at world
    size 1 every row is the rank's own, grouped already, and the local path stores them) and in the ranks layout,
    a row per record (PACK_RANKS); else in place as records land (PACK_NONE)."""
    if cfg.layout == "packed":
        return C.PACK_LAYOUT
    if cfg.layout == "ranks":
        return C.PACK_RANKS
    return C.PACK_BY_SOURCE if cfg.group_by_source and cfg.world_size > 1 else C.PACK_NONE


def backward_kernels(cfg):
    """{operation: its kernel} of the backward calls (cuda/backward.cu): the local path's (local()) where it
    is taken, whose blocks wait for nothing; else each operation in one launch of a resident grid."""
    return dict(GRAD_KERNELS, **LOCAL_GRAD_KERNELS) if local(cfg) else dict(GRAD_KERNELS)


def whole_kernels(cfg, sms):
    """{phase: the kernel that runs its two halves in one launch}: the local path's (local()), whose dispatch has
    a kernel of its own (LOCAL_TOKENS) where every token of max_num_tokens gets a block; else the dispatch of
    streamed (prefill-sized) batches is its own kernel, so the small batches' kernel carries none of its code;
    so is the combine on an FP8 combine wire. The ranks layout at world size 1 combines on the local path too
    (each token's one row where the dispatch placed it, read in place: no partial sum)."""
    whole = dict(WHOLE_KERNELS, dispatch=STREAMED_DISPATCH) if streamed(cfg, sms) else WHOLE_KERNELS
    whole = {phase: _on_wire(cfg, n) for phase, n in whole.items()}
    if local(cfg):
        every_token = _send_blocks(cfg, sms) >= cfg.max_num_tokens  # a block per token: no block has two
        whole["dispatch"] = LOCAL_TOKENS if every_token else LOCAL_KERNELS["dispatch"]
    if (local(cfg) or (cfg.world_size == 1 and pack(cfg) == C.PACK_RANKS)) and cfg.combine_wire is None:
        whole["combine"] = LOCAL_KERNELS["combine"]
    return whole


def module_variant(cfg, sms, variant, all_mapped):
    """The variant whose module the kernels come from: ``variant``'s put-free twin at prefill-sized batches
    (streamed) in a group whose every peer is mapped, else ``variant`` (smaller batches, and every batch of a
    group with a network peer)."""
    twin = PUT_FREE_TWIN.get(variant)
    return twin if twin and all_mapped and streamed(cfg, sms) else variant


# The plan ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchPlan:
    """What a GPU AllToAll launches, decided once at construction (:func:`launch_plan`).

    Attributes:
        variant: the module the kernels come from (a key of moecomm._jit.VARIANTS).
        sms: the SM budget the grids are sized for.
        grids: {kernel: blocks} of every kernel below.
        halves: {half (moecomm._constants.HALVES): its kernels, in launch order}: a half requested alone.
        whole: {phase: its kernels}: a phase whose two halves are requested together.
        fallback: {phase: why} where ``whole`` runs the halves' kernels because the one-launch kernel's grid
            is not resident at once; empty in the common case.
        streamed: prefill-sized batches: dispatch records carry arrival words (Fixed.streamed).
        combine_streams: the one-launch combine streams its partial sums (Fixed.comb_streamed).
        senders: blocks of the one-launch dispatch that send (Fixed.senders).
        backward: {operation ("plan", "dispatch_backward", "combine_backward"): its kernel} (gradients=True),
            else empty; their grids are in ``grids``.
        stage_rows: staging rows the kernels that stage rows need (a block's at blockIdx * STAGE_SLOTS).
        dispatch_sources: a whole dispatch given sources (AllToAll.dispatch(sources=...)) writes them in its own
            launch (the local path of small batches, LOCAL_TOKENS: its last block, from the records its blocks
            wrote), instead of SOURCE_LAYOUT's launch after it.
    """
    variant: str
    sms: int
    grids: dict
    halves: dict
    whole: dict
    fallback: dict
    streamed: bool
    combine_streams: bool
    senders: int
    backward: dict
    stage_rows: int
    dispatch_sources: bool

    def summary(self):
        """The plan as ``a2a.stats()["plan"]`` reports it: plain Python values."""
        return {"variant": self.variant, "sm_budget": self.sms, "grids": dict(self.grids),
                "halves": {h: list(k) for h, k in self.halves.items()},
                "whole": {p: list(k) for p, k in self.whole.items()}, "fallback": dict(self.fallback),
                "streamed": self.streamed, "combine_streams": self.combine_streams, "backward": dict(self.backward),
                "dispatch_sources": self.dispatch_sources}


def launch_plan(cfg, num_sms, variant, all_mapped=True):
    """The :class:`LaunchPlan` of an AllToAll of ``cfg`` on a GPU of ``num_sms`` SMs, over the transport whose
    module is ``variant``; ``all_mapped``: every rank maps every peer (agreed by the ranks at init, so every
    rank plans alike)."""
    sms = sm_budget(cfg, num_sms)
    halves = dict(zip(C.HALVES, ((n,) for n in half_kernels(cfg))))
    grids = {n: GRIDS[n](cfg, sms) for kernels in halves.values() for n in kernels}
    whole, fallback = {}, {}
    for phase, name in whole_kernels(cfg, sms).items():
        blocks = GRIDS[name](cfg, sms)
        split = halves[f"{phase}_send"] + halves[f"{phase}_recv"]
        if resident(blocks, num_sms):
            grids[name], whole[phase] = blocks, (name,)
        else:
            whole[phase] = split
            fallback[phase] = (f"{name}'s {blocks} blocks are not resident at once on {num_sms} SMs "
                               f"({C.BLOCKS_PER_SM} per SM): the halves' kernels run back to back")
    backward = backward_kernels(cfg) if cfg.gradients else {}
    grids.update({n: GRIDS[n](cfg, sms) for n in backward.values()})
    if cfg.slots_by_source:  # AllToAll.source_layout
        grids[SOURCE_LAYOUT] = GRIDS[SOURCE_LAYOUT](cfg, sms)
    if cfg.layout == "ranks":  # AllToAll.row_routing
        grids[ROW_ROUTING] = GRIDS[ROW_ROUTING](cfg, sms)
    stagers = [halves["dispatch_send"][0], halves["combine_send"][0], *(k[0] for k in whole.values()),
               *(n for op, n in backward.items() if op != "plan" and n == GRAD_KERNELS[op])]  # the exchanging ones
    stage_rows = max(grids[n] for n in stagers) * C.STAGE_SLOTS
    assert max(grids.values()) < C.MAX_GRID_BLOCKS, grids  # a block count's high bits carry a flag (count_block)
    module = module_variant(cfg, sms, variant, all_mapped)
    return LaunchPlan(variant=module, sms=sms, grids=grids, halves=halves, whole=whole, fallback=fallback,
                      streamed=streamed(cfg, sms), combine_streams=combine_streams(cfg, sms, module),
                      senders=dispatch_senders(cfg, sms), backward=backward, stage_rows=stage_rows,
                      dispatch_sources=cfg.slots_by_source and whole.get("dispatch") == (LOCAL_TOKENS,))
