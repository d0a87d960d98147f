"""The configuration of one AllToAll, validated once, and the buffer shapes derived from it."""
from dataclasses import MISSING, dataclass, fields

import numpy as np

from . import _constants as C
from ._dtypes import (IN_DTYPES, OUT_DTYPES, SCALE_DTYPES, as_dtype, bfloat16, float8_e4m3fn, float8_e8m0fnu, float16,
                      float32, int32)
from ._errors import InvalidArgument


def positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _quantised_scales(wire, in_dtype, hidden_dim, hidden_dim_scale, scale_dtype):
    """(hidden_dim_scale, scale_dtype) of a quantising dispatch (AllToAllConfig.dispatch_wire): a scale per
    COMBINE_BLOCK values, float32 by default; with "e4m3_ue8m0" also UE8M0 bytes or int32 of four. Raises
    InvalidArgument for what it cannot quantise."""
    if wire not in C.WIRE_CODES or wire is None:
        raise InvalidArgument(f"dispatch_wire must be one of {list(C.WIRE_CODES)}, got {wire!r}")
    if in_dtype not in (bfloat16, float16):
        raise InvalidArgument(f"dispatch_wire={wire!r} quantises bfloat16 or float16 tokens, in_dtype is {in_dtype}")
    if hidden_dim % C.COMBINE_BLOCK:
        raise InvalidArgument(f"dispatch_wire={wire!r} needs hidden_dim a multiple of {C.COMBINE_BLOCK} (one scale "
                              f"per {C.COMBINE_BLOCK} values), got {hidden_dim}")
    allowed = (float32,) if wire == "e4m3" else (float32, float8_e8m0fnu, int32)
    scale_dtype = as_dtype(float32 if scale_dtype is None else scale_dtype, allowed,
                           f"dispatch_wire={wire!r}: scale_dtype")
    blocks = hidden_dim // C.COMBINE_BLOCK
    if scale_dtype == int32 and blocks % 4:
        raise InvalidArgument(f"scale_dtype int32 packs four UE8M0 scales: hidden_dim / {C.COMBINE_BLOCK} = {blocks} "
                              f"is not a multiple of 4")
    derived = blocks // 4 if scale_dtype == int32 else blocks
    if hidden_dim_scale is not None and hidden_dim_scale != derived:
        raise InvalidArgument(f"hidden_dim_scale={hidden_dim_scale}: dispatch_wire={wire!r} makes {derived} scales of "
                              f"{scale_dtype} a token (leave it None)")
    return derived, scale_dtype


def options_of(config_class):
    """{name: default} of the fields of ``config_class`` (AllToAllConfig) that have defaults: AllToAll's options
    (``**options``), in the fields' order."""
    return {f.name: f.default for f in fields(config_class) if f.default is not MISSING}


@dataclass(frozen=True)
class AllToAllConfig:
    """Everything that fixes an AllToAll's buffers. Identical on every rank (checked at construction).

    Fields:
        world_size, rank: the communicator's.
        max_num_tokens: most tokens one rank dispatches per call (m <= this).
        num_experts: experts in total; rank r owns experts r*E/W ... (r+1)*E/W - 1.
        experts_per_token: top-k, 1..16.
        hidden_dim: values per token.
        hidden_dim_scale: scale values per token, or None when tokens carry no scales.
        in_dtype / out_dtype / scale_dtype: numpy dtypes (bf16/fp16/fp8 e4m3/uint8 opaque bytes; bf16/fp16;
            float32, UE8M0 (float8_e8m0fnu), int32 (four UE8M0 per int32) or None). Scales and opaque rows pass
            through bit-exactly. in_dtype is dp_x's; out_expert_x has expert_dtype.
        dispatch_wire: None (default: tokens travel as given) or "e4m3" / "e4m3_ue8m0": dispatch takes
            bfloat16 or float16 tokens (``in_dtype``; no ``dp_x_scale``) and quantises each block of 128 values
            to FP8 e4m3 with one scale, absmax / 448 (rounded up to a power of two with "e4m3_ue8m0"), as
            DeepEP's and NCCL EP's FP8 dispatch do: out_expert_x is float8_e4m3fn and out_expert_x_scale has
            hidden_dim / 128 scales a token in ``scale_dtype`` (float32, the default; with "e4m3_ue8m0" also
            float8_e8m0fnu, or int32 of four UE8M0: DeepEP's ``use_ue8m0``), laid out by ``scale_layout``;
            ``hidden_dim_scale`` is derived (leave it None). The sender quantises once, in the kernel that
            reads the row; ``moecomm.reference.quantize_tokens`` is the rounding, bit for bit. hidden_dim a
            multiple of 128.
        dp_size: ranks per data-parallel group (they hold the same tokens); divides world_size.
        slots_per_rank: replicated experts: each rank holds this many physical expert slots, ``indices`` are
            logical expert ids, and an :class:`moecomm.balance.ExpertMap` (``expert_map``; at first
            :meth:`ExpertMap.static <moecomm.balance.ExpertMap.static>`, changed by
            :meth:`moecomm.AllToAll.set_expert_map`) says which logical expert each slot holds. Each (token,
            logical expert) goes to one replica by the map's rule; the outputs are per local slot
            (``num_local_experts`` = slots_per_rank). None (default): rank r owns experts
            r*E/W ... (r+1)*E/W - 1.
        capacity: slots per local expert (the second dimension of out_expert_x), or None: the worst case,
            max_num_tokens * (world_size // dp_size), which never overflows. Needs dp_size == 1.
        overflow: when a local expert is routed more (token, expert) pairs than ``capacity``: "error" (the
            call raises CapacityExceeded on every rank, naming the expert and its demand; nothing is
            exchanged, the next call works; on GPUs the dispatch's other pairs were delivered and the error
            is raised once the call is over, as other kernel errors are) or "drop" (pairs past the capacity
            are not stored and add nothing in combine; counted in ``stats()`` on the expert's rank and
            reported per pair by combine's ``out_dropped``). Which pairs drop: on the host transport those
            last in (source rank, token, top-k) order; on GPUs those whose slots were taken last (the
            order of arrival, unspecified). On GPUs a dropped pair's token still crosses the link when
            it goes to that rank at all (the receiver drops).
        layout: "padded" (default: out_expert_x [num_local_experts, capacity, hidden_dim]) or "packed": the
            rank's received rows back to back, expert by expert (out_expert_x [capacity, hidden_dim] with
            capacity rows per rank, default the worst case max_num_tokens * DP groups * min(top-k, local
            experts); dispatch writes out_expert_offsets [num_local_experts + 1]; expert_y likewise), the
            layout a contiguous grouped GEMM takes. With a capacity the policy applies to the rank's rows.
            On GPUs a third kernel places the rows once the counts are known (rows within an expert in
            order of arrival).
        scale_layout: "row" (default: out_expert_x_scale [L, capacity, scales]) or "column" ([L, scales,
            capacity], packed [scales, capacity]: each expert's scales column-major, the layout DeepGEMM's
            TMA loads take; pick a capacity that is a multiple of 16 bytes of scales for its alignment).
        max_sms: None (default: the kernels' grids are sized for the whole GPU), or the most SMs they are
            sized for (at most 2 blocks per SM; at least world_size / 2 SMs), leaving the others to work on
            other streams (a shared expert, another micro-batch), as DeepEP's ``Buffer.set_num_sms`` does. A
            phase that runs in one launch needs its whole grid resident at once (but at world size 1 in the
            padded layout, where no block waits for another: docs/design.md, the local path): work that holds
            SMs only delays it.
            GPU transports (the host transport has no kernels); the same on every rank.
        gradients: False (default) or True: GPU transports allocate what :meth:`moecomm.AllToAll.plan`,
            :meth:`moecomm.AllToAll.dispatch_backward` and :meth:`moecomm.AllToAll.combine_backward` need (a
            gradient row buffer of world_size * max_num_tokens rows of about 4 * hidden_dim bytes in symmetric
            memory: ``tools/memory_report.py``), and dispatch records each pair's expert for the plan. Training
            sets it; the host transport computes gradients either way. The same on every rank.
        combine_wire: None (default: combine's rows travel in out_dtype) or "e4m3" / "e4m3_ue8m0": the
            expert side quantises each row it sends (a partial sum when the weights came with dispatch, else
            an expert's row) to FP8 e4m3 with one float32 (or UE8M0, a power of two) scale per 128 values, and
            the token side dequantises and sums in float32: about half the bytes back, each value within
            2^-4 of itself (e4m3's rounding; ``moecomm.reference.quantize_e4m3``). hidden_dim a multiple
            of 128.
        num_tags: 0 (default) or the number of tags (up to 256: tenant, language or task ids the caller
            assigns) that :meth:`moecomm.AllToAll.dispatch` may give each token (``tags``): the pairs each local expert
            receives are then counted per tag and call, in the telemetry window (``stats()["by_tag"]``).
        score_gap: False (default) or True: dispatch given router weights histograms each token's gap
            between its largest and smallest weight (the router's confidence; bins
            ``moecomm._constants.GAP_EDGES``, the first the near ties), per call in the telemetry window
            (``stats()["score_gap"]``).
        kernel_names: "moecomm" (default: each half of a phase is a kernel of its own, ``moecomm_dispatch_send``
            ...) or "deep_ep": the split halves run under DeepEP's profiler names, one kernel per phase
            (``moecomm::deep_ep::dispatch``, ``moecomm::deep_ep::combine``), so that tools that time DeepEP's
            kernels by name (its tests' ``bench_kineto``) find ours; the same code. On an FP8 combine wire the
            combine keeps its own names. GPU transports; the same on every rank.
        group_by_source: False (default: in the padded layout each expert's slots go to pairs as they arrive,
            sources interleaved) or True: each expert's slots hold its pairs grouped by source rank, in rank
            order, each source's pairs in consecutive slots (DeepEP's low-latency layout, whose
            ``recv_layout_range`` names each source's range; :meth:`moecomm.AllToAll.source_layout` writes it
            here). At world size > 1 the rows are then placed once every count is known (the packed layout's
            third dispatch kernel): one more pass over the received rows. The packed layout always groups its
            rows so.
    """
    world_size: int
    rank: int
    max_num_tokens: int
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    hidden_dim_scale: object
    in_dtype: np.dtype
    out_dtype: np.dtype
    scale_dtype: object
    dp_size: int
    slots_per_rank: object = None
    capacity: object = None
    overflow: str = "error"
    layout: str = "padded"
    scale_layout: str = "row"
    combine_wire: object = None
    max_sms: object = None
    gradients: bool = False
    num_tags: int = 0
    score_gap: bool = False
    dispatch_wire: object = None
    kernel_names: str = "moecomm"
    group_by_source: bool = False

    @classmethod
    def create(cls, world_size, rank, max_num_tokens, num_experts, experts_per_token, hidden_dim,
               hidden_dim_scale, in_dtype, out_dtype, scale_dtype, dp_size, **options):
        """Validate the arguments of :class:`moecomm.AllToAll`; raise InvalidArgument on the first bad one.
        ``options``: the fields with defaults (:func:`options_of`) by name; the others keep their defaults."""
        defaults = options_of(cls)
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise InvalidArgument(f"unknown option(s) {', '.join(unknown)}: AllToAll's options are "
                                  f"{', '.join(defaults)} (docs/api.md)")
        given = dict(defaults, **options)
        (slots_per_rank, capacity, overflow, layout, scale_layout, combine_wire, max_sms, gradients, num_tags,
         score_gap, dispatch_wire, kernel_names, group_by_source) = (given[name] for name in defaults)  # fields' order
        max_num_tokens = positive_int("max_num_tokens", max_num_tokens)
        if max_num_tokens >= 1 << C.SIG_COUNT_BITS:
            raise InvalidArgument(f"max_num_tokens={max_num_tokens} must be < {1 << C.SIG_COUNT_BITS}")
        num_experts = positive_int("num_experts", num_experts)
        k = positive_int("experts_per_token", experts_per_token)
        hidden_dim = positive_int("hidden_dim", hidden_dim)
        dp_size = positive_int("dp_size", dp_size)
        if num_experts > C.MAX_EXPERTS:
            raise InvalidArgument(f"num_experts={num_experts} exceeds the supported {C.MAX_EXPERTS}")
        if num_experts % world_size:
            raise InvalidArgument(
                f"num_experts={num_experts} must be a multiple of world_size={world_size}")
        if k > min(C.MAX_TOPK, num_experts):
            raise InvalidArgument(
                f"experts_per_token={k} must be <= min({C.MAX_TOPK}, num_experts={num_experts})")
        if world_size % dp_size:
            raise InvalidArgument(f"dp_size={dp_size} must divide world_size={world_size}")
        in_dtype = as_dtype(in_dtype, IN_DTYPES, "in_dtype")
        out_dtype = as_dtype(out_dtype, OUT_DTYPES, "out_dtype")
        for name, dt in (("in_dtype", in_dtype), ("out_dtype", out_dtype)):
            if (hidden_dim * dt.itemsize) % C.ROW_ALIGN:
                raise InvalidArgument(
                    f"hidden_dim={hidden_dim} with {name}={dt} gives rows of "
                    f"{hidden_dim * dt.itemsize} bytes; rows must be a multiple of {C.ROW_ALIGN} bytes")
        if dispatch_wire is not None:
            hidden_dim_scale, scale_dtype = _quantised_scales(dispatch_wire, in_dtype, hidden_dim, hidden_dim_scale,
                                                              scale_dtype)
        if hidden_dim_scale is None:
            if scale_dtype is not None:
                raise InvalidArgument("scale_dtype given but hidden_dim_scale is None")
        else:
            hidden_dim_scale = positive_int("hidden_dim_scale", hidden_dim_scale)
            scale_dtype = as_dtype(float32 if scale_dtype is None else scale_dtype,
                                   SCALE_DTYPES, "scale_dtype")
            if (hidden_dim_scale * scale_dtype.itemsize) % C.SCALE_ALIGN:
                raise InvalidArgument(f"hidden_dim_scale={hidden_dim_scale} scales of {scale_dtype} are "
                                      f"{hidden_dim_scale * scale_dtype.itemsize} bytes a token; a token's scales "
                                      f"must be a multiple of {C.SCALE_ALIGN} bytes")
        if scale_layout not in ("row", "column"):
            raise InvalidArgument(f"scale_layout must be 'row' or 'column', got {scale_layout!r}")
        if scale_layout == "column" and hidden_dim_scale is None:
            raise InvalidArgument("scale_layout='column' needs scales (hidden_dim_scale)")
        if combine_wire not in C.WIRE_CODES:
            raise InvalidArgument(f"combine_wire must be one of {list(C.WIRE_CODES)}, got {combine_wire!r}")
        if combine_wire is not None and hidden_dim % C.COMBINE_BLOCK:
            raise InvalidArgument(f"combine_wire={combine_wire!r} needs hidden_dim a multiple of "
                                  f"{C.COMBINE_BLOCK} (one scale per {C.COMBINE_BLOCK} values), got {hidden_dim}")
        if max_sms is not None:
            max_sms = positive_int("max_sms", max_sms)
            if C.BLOCKS_PER_SM * max_sms < world_size:  # a receive grid has a block per source rank at least
                raise InvalidArgument(f"max_sms={max_sms}: the kernels need a block per rank, "
                                      f"{C.BLOCKS_PER_SM} per SM: at least {-(-world_size // C.BLOCKS_PER_SM)} SMs "
                                      f"at world size {world_size}")
        if slots_per_rank is not None:
            slots_per_rank = positive_int("slots_per_rank", slots_per_rank)
            if slots_per_rank < num_experts // world_size:
                raise InvalidArgument(f"slots_per_rank={slots_per_rank} must be >= num_experts / world_size = "
                                      f"{num_experts // world_size} (every expert needs a slot)")
        if overflow not in ("error", "drop"):
            raise InvalidArgument(f"overflow must be 'error' or 'drop', got {overflow!r}")
        if layout not in ("padded", "packed"):
            raise InvalidArgument(f"layout must be 'padded' or 'packed', got {layout!r}")
        local = num_experts // world_size if slots_per_rank is None else slots_per_rank
        if capacity is not None:
            worst = max_num_tokens * (world_size // dp_size) * (min(k, local) if layout == "packed" else 1)
            capacity = positive_int("capacity", capacity)
            if capacity > worst:
                raise InvalidArgument(f"capacity={capacity} exceeds the worst case max_num_tokens * DP groups = "
                                      f"{worst} (leave it None for that)")
            if dp_size != 1:
                raise InvalidArgument("capacity: needs dp_size == 1 so far")
        if kernel_names not in C.KERNEL_NAMES:
            raise InvalidArgument(f"kernel_names must be one of {list(C.KERNEL_NAMES)}, got {kernel_names!r}")
        num_tags = positive_int("num_tags", num_tags, minimum=0)
        if num_tags > C.MAX_TAGS:
            raise InvalidArgument(f"num_tags={num_tags} exceeds the supported {C.MAX_TAGS}")
        gradients, score_gap, group_by_source = bool(gradients), bool(score_gap), bool(group_by_source)
        checked = locals()
        return cls(world_size, rank, max_num_tokens, num_experts, k, hidden_dim, hidden_dim_scale, in_dtype, out_dtype,
                   scale_dtype, dp_size, **{name: checked[name] for name in defaults})

    # Derived layout -------------------------------------------------------------------------
    @property
    def expert_dtype(self):
        """out_expert_x's dtype, the tokens' as they travel: float8_e4m3fn with a dispatch_wire, else in_dtype."""
        return float8_e4m3fn if self.dispatch_wire is not None else self.in_dtype

    @property
    def num_local_experts(self):
        """Experts (physical slots with replicas) on each rank."""
        return self.num_experts // self.world_size if self.slots_per_rank is None else self.slots_per_rank

    @property
    def num_dp_groups(self):
        return self.world_size // self.dp_size

    @property
    def dp_group(self):
        return self.rank // self.dp_size

    @property
    def dp_rank(self):
        return self.rank % self.dp_size

    @property
    def expert_capacity(self):
        """Padded layout: slots per local expert (``capacity``, else the worst case, every token of every DP
        group reaching one expert once). Packed layout: rows per rank (``capacity``, else the worst case,
        every token of every DP group reaching min(top-k, local experts) of the rank's experts)."""
        if self.capacity is not None:
            return self.capacity
        worst = self.max_num_tokens * self.num_dp_groups
        return worst * min(self.experts_per_token, self.num_local_experts) if self.layout == "packed" else worst

    @property
    def drops(self):
        """Whether pairs past an expert's capacity may be dropped (a capacity set with overflow="drop"): only
        then are drop words kept."""
        return self.capacity is not None and self.overflow == "drop"

    @property
    def slots_by_source(self):
        """Whether each expert's slots hold its rows grouped by source rank, in rank order (what
        AllToAll.source_layout describes): the padded layout with group_by_source, or at world size 1 (every
        row is the rank's own)."""
        return self.layout == "padded" and (self.group_by_source or self.world_size == 1)

    def expert_x_shape(self):
        if self.layout == "packed":
            return (self.expert_capacity, self.hidden_dim)
        return (self.num_local_experts, self.expert_capacity, self.hidden_dim)

    def expert_x_scale_shape(self):
        rows = (self.expert_capacity, self.hidden_dim_scale)
        rows = rows[::-1] if self.scale_layout == "column" else rows
        return rows if self.layout == "packed" else (self.num_local_experts, *rows)

    def key(self):
        """The fields that must be equal on every rank (every field but rank), by name; dtypes by name."""
        return {f.name: str(v) if isinstance(v, np.dtype) else v
                for f in fields(self) if f.name != "rank" for v in (getattr(self, f.name),)}
