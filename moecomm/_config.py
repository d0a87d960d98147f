"""The configuration of one AllToAll, validated once, and the buffer shapes derived from it."""
from dataclasses import dataclass, fields

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
    """(hidden_dim_scale, scale_dtype) of a quantising dispatch (Formats.dispatch_wire, not None): a scale per
    COMBINE_BLOCK values, float32 by default; with "e4m3_ue8m0" also UE8M0 bytes or int32 of four. Raises
    InvalidArgument for what it cannot quantise."""
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


def _setting(name, value, choices):
    if value not in choices:
        raise InvalidArgument(f"{name} must be one of {list(choices)}, got {value!r}")


def _set(group, name, value):
    object.__setattr__(group, name, value)  # a frozen group normalising its own field


@dataclass(frozen=True)
class Formats:
    """How the rows travel and how scales are laid out (``AllToAll(formats=...)``, or these names as keywords).

    Fields:
        dispatch_wire: None (default: tokens travel as given) or "e4m3" / "e4m3_ue8m0": dispatch takes
            bfloat16 or float16 tokens (``in_dtype``; no ``dp_x_scale``) and quantises each block of 128 values
            to FP8 e4m3 with one scale, absmax / 448 (rounded up to a power of two with "e4m3_ue8m0"), as
            DeepEP's and NCCL EP's FP8 dispatch do: out_expert_x is float8_e4m3fn and out_expert_x_scale has
            hidden_dim / 128 scales a token in ``scale_dtype`` (float32, the default; with "e4m3_ue8m0" also
            float8_e8m0fnu, or int32 of four UE8M0: DeepEP's ``use_ue8m0``), laid out by ``scale_layout``;
            ``hidden_dim_scale`` is derived (leave it None). The sender quantises once, in the kernel that
            reads the row; ``moecomm.reference.quantize_tokens`` is the rounding, bit for bit. hidden_dim a
            multiple of 128.
        combine_wire: None (default: combine's rows travel in out_dtype) or "e4m3" / "e4m3_ue8m0": the
            expert side quantises each row it sends (a partial sum when the weights came with dispatch, else
            an expert's row) to FP8 e4m3 with one float32 (or UE8M0, a power of two) scale per 128 values, and
            the token side dequantises and sums in float32: about half the bytes back, each value within
            2^-4 of itself (e4m3's rounding; ``moecomm.reference.quantize_e4m3``). hidden_dim a multiple
            of 128.
        scale_layout: "row" (default: out_expert_x_scale [L, capacity, scales]) or "column" ([L, scales,
            capacity], packed [scales, capacity]: each expert's scales column-major, the layout DeepGEMM's
            TMA loads take; pick a capacity that is a multiple of 16 bytes of scales for its alignment).
    """
    dispatch_wire: object = None
    combine_wire: object = None
    scale_layout: str = "row"

    def __post_init__(self):
        _setting("dispatch_wire", self.dispatch_wire, C.WIRE_CODES)
        _setting("combine_wire", self.combine_wire, C.WIRE_CODES)
        _setting("scale_layout", self.scale_layout, ("row", "column"))


@dataclass(frozen=True)
class Placement:
    """Where received rows go: the layout, each expert's capacity and what happens past it, replicated experts
    (``AllToAll(placement=...)``, or these names as keywords).

    Fields:
        layout: "padded" (default: out_expert_x [num_local_experts, capacity, hidden_dim]) or "packed": the
            rank's received rows back to back, expert by expert (out_expert_x [capacity, hidden_dim] with
            capacity rows per rank, default the worst case max_num_tokens * DP groups * min(top-k, local
            experts); dispatch writes out_expert_offsets [num_local_experts + 1]; expert_y likewise), the
            layout a contiguous grouped GEMM takes. With a capacity the policy applies to the rank's rows.
            On GPUs the receive half's blocks place the rows once every count is known (rows within an
            expert grouped by source rank, in rank order; a source's in order of arrival). Or "ranks": each
            token once per rank that owns any of its experts (DeepEP's normal mode, the training and prefill
            pattern): out_expert_x [capacity, hidden_dim] (capacity max_num_tokens * world_size, the worst
            case) holds one row per received token, grouped by source rank in rank order, each source's in
            token order (so the same routing places every row alike, call after call); dispatch writes
            out_expert_offsets [world_size + 1] (source s's rows are offsets[s]..offsets[s + 1] - 1) and
            out_expert_num_tokens the pairs per local expert; :meth:`moecomm.AllToAll.row_routing` writes each
            row's local expert ids and weights. Combine takes one row per received token (expert_y
            [capacity, hidden_dim]: its experts' outputs, reduced by the caller) and sums each token's rows
            over the ranks, unweighted (weights None); ``expert_weights`` / ``out_weights`` carry float32
            rows [capacity, top-k] back the same way (on GPUs after each row, in the same transfer). dp_size 1,
            no capacity, no replicas, no combine_wire.
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
            it goes to that rank at all (the receiver drops). Without a capacity nothing overflows.
        group_by_source: False (default: in the padded layout each expert's slots go to pairs as they arrive,
            sources interleaved) or True: each expert's slots hold its pairs grouped by source rank, in rank
            order, each source's pairs in consecutive slots (DeepEP's low-latency layout, whose
            ``recv_layout_range`` names each source's range; :meth:`moecomm.AllToAll.source_layout` writes it
            here). At world size > 1 the rows are then placed once every count is known, as the packed
            layout's are (by the receive half's blocks): one more pass over the received rows. The packed
            layout always groups its rows so.
        slots_per_rank: replicated experts: each rank holds this many physical expert slots, ``indices`` are
            logical expert ids, and an :class:`moecomm.balance.ExpertMap` (``expert_map``; at first
            :meth:`ExpertMap.static <moecomm.balance.ExpertMap.static>`, changed by
            :meth:`moecomm.AllToAll.set_expert_map`) says which logical expert each slot holds. Each (token,
            logical expert) goes to one replica by the map's rule; the outputs are per local slot
            (``num_local_experts`` = slots_per_rank). None (default): rank r owns experts
            r*E/W ... (r+1)*E/W - 1.
    """
    layout: str = "padded"
    capacity: object = None
    overflow: str = "error"
    group_by_source: bool = False
    slots_per_rank: object = None

    def __post_init__(self):
        _setting("layout", self.layout, ("padded", "packed", "ranks"))
        _setting("overflow", self.overflow, ("error", "drop"))
        if self.capacity is not None:
            _set(self, "capacity", positive_int("capacity", self.capacity))
        if self.slots_per_rank is not None:
            _set(self, "slots_per_rank", positive_int("slots_per_rank", self.slots_per_rank))
        _set(self, "group_by_source", bool(self.group_by_source))


@dataclass(frozen=True)
class Telemetry:
    """What :meth:`moecomm.AllToAll.stats` keeps per call (``AllToAll(telemetry=...)``, or these names as
    keywords). The MASKED/DROPPED/CALLS counters and per-expert drops are always kept.

    Fields:
        telemetry_window: calls whose per-expert routing counts are kept (on the device by the kernels;
            default 64). 0 turns the telemetry off (the window, tokens received per expert and bytes per
            peer), and with it what is counted per call in the window: ``num_tags``, ``score_gap`` and
            ``timing`` then raise InvalidArgument.
        timing: also time each phase of the last ``telemetry_window`` calls (CUDA events on the call's stream,
            eager calls only; host time on the host transport): ``stats()["times_us"]``.
        num_tags: 0 (default) or the number of tags (up to 256: tenant, language or task ids the caller
            assigns) that :meth:`moecomm.AllToAll.dispatch` may give each token (``tags``): the pairs each local expert
            receives are then counted per tag and call, in the telemetry window (``stats()["by_tag"]``).
        score_gap: False (default) or True: dispatch given router weights histograms each token's gap
            between its largest and smallest weight (the router's confidence; bins
            ``moecomm._constants.GAP_EDGES``, the first the near ties), per call in the telemetry window
            (``stats()["score_gap"]``).
    """
    telemetry_window: int = C.DEFAULT_WINDOW
    timing: bool = False
    num_tags: int = 0
    score_gap: bool = False

    def __post_init__(self):
        _set(self, "telemetry_window", positive_int("telemetry_window", self.telemetry_window, minimum=0))
        _set(self, "num_tags", positive_int("num_tags", self.num_tags, minimum=0))
        if self.num_tags > C.MAX_TAGS:
            raise InvalidArgument(f"num_tags={self.num_tags} exceeds the supported {C.MAX_TAGS}")
        _set(self, "timing", bool(self.timing))
        _set(self, "score_gap", bool(self.score_gap))
        kept = [name for name in ("num_tags", "score_gap", "timing") if getattr(self, name)]
        if self.telemetry_window == 0 and kept:
            raise InvalidArgument(f"{', '.join(kept)}: counted per call in the telemetry window, which "
                                  f"telemetry_window=0 turns off: give the window a size, or leave them off")


@dataclass(frozen=True)
class Launch:
    """How the GPU kernels are built and launched (``AllToAll(launch=...)``, or these names as keywords); GPU
    transports (the host transport has no kernels); the same on every rank.

    Fields:
        max_sms: None (default: the kernels' grids are sized for the whole GPU), or the most SMs they are
            sized for (at most 2 blocks per SM; at least world_size / 2 SMs), leaving the others to work on
            other streams (a shared expert, another micro-batch), as DeepEP's ``Buffer.set_num_sms`` does. A
            phase that runs in one launch needs its whole grid resident at once (but at world size 1 in the
            padded layout, where no block waits for another: docs/design.md, the local path): work that holds
            SMs only delays it.
        gradients: False (default) or True: GPU transports allocate what :meth:`moecomm.AllToAll.plan`,
            :meth:`moecomm.AllToAll.dispatch_backward` and :meth:`moecomm.AllToAll.combine_backward` need (a
            gradient row buffer of world_size * max_num_tokens rows of about 4 * hidden_dim bytes in symmetric
            memory: ``tools/memory_report.py``), and dispatch records each pair's expert for the plan. Training
            sets it; the host transport computes gradients either way.
        kernel_names: "moecomm" (default: each half of a phase is a kernel of its own, ``moecomm_dispatch_send``
            ...) or "deep_ep": the split halves run under DeepEP's profiler names, one kernel per phase
            (``moecomm::deep_ep::dispatch``, ``moecomm::deep_ep::combine``), so that tools that time DeepEP's
            kernels by name (its tests' ``bench_kineto``) find ours; the same code. On an FP8 combine wire the
            combine keeps its own names.
    """
    max_sms: object = None
    gradients: bool = False
    kernel_names: str = "moecomm"

    def __post_init__(self):
        if self.max_sms is not None:
            _set(self, "max_sms", positive_int("max_sms", self.max_sms))
        _set(self, "gradients", bool(self.gradients))
        _setting("kernel_names", self.kernel_names, C.KERNEL_NAMES)


GROUPS = {"formats": Formats, "placement": Placement, "telemetry": Telemetry, "launch": Launch}
_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}  # {option: its group}


def groups_of(options):
    """{group name: group}: the options given as keywords (a group's fields by name) or as groups (``formats=
    Formats(...)`` or a dict of its fields), each group made and checked once. An unknown name, or a group given
    both ways, raises InvalidArgument."""
    unknown = sorted(set(options) - set(_GROUP_OF) - set(GROUPS))
    if unknown:
        raise InvalidArgument(f"unknown option(s) {', '.join(unknown)}: AllToAll's options are the groups "
                              f"{', '.join(GROUPS)} or their fields {', '.join(_GROUP_OF)} (docs/api.md)")
    made = {}
    for group, cls in GROUPS.items():
        flat = {name: options[name] for name in options if _GROUP_OF.get(name) == group}
        given = options.get(group)
        if given is not None and flat:
            raise InvalidArgument(f"{', '.join(flat)}: given both as keywords and in {group}=: give one")
        if isinstance(given, dict):
            names = [f.name for f in fields(cls)]
            if not set(given) <= set(names):
                raise InvalidArgument(f"{group}: its fields are {', '.join(names)}, got {', '.join(sorted(given))}")
            given = cls(**given)
        elif given is not None and not isinstance(given, cls):
            raise InvalidArgument(f"{group} must be a moecomm.{cls.__name__} or a dict, got {type(given).__name__}")
        made[group] = given if given is not None else cls(**flat)
    return made


@dataclass(frozen=True)
class AllToAllConfig:
    """Everything that fixes an AllToAll's buffers: the shape of its calls, then its option groups. Identical on
    every rank (checked at construction). An option reads as an attribute of the config too (``cfg.capacity``
    is ``cfg.placement.capacity``).

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
        dp_size: ranks per data-parallel group (they hold the same tokens); divides world_size.
        formats, placement, telemetry, launch: the option groups (:class:`Formats`, :class:`Placement`,
            :class:`Telemetry`, :class:`Launch`: each says what its options do).
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
    formats: Formats = Formats()
    placement: Placement = Placement()
    telemetry: Telemetry = Telemetry()
    launch: Launch = Launch()

    def __post_init__(self):  # each option read as an attribute, from its group (set once: calls read them)
        for name, group in _GROUP_OF.items():
            object.__setattr__(self, name, getattr(getattr(self, group), name))

    @classmethod
    def create(cls, world_size, rank, max_num_tokens, num_experts, experts_per_token, hidden_dim,
               hidden_dim_scale, in_dtype, out_dtype, scale_dtype, dp_size, **options):
        """Validate the arguments of :class:`moecomm.AllToAll`; raise InvalidArgument on the first bad one.
        ``options``: the option groups or their fields by name (:func:`groups_of`); the others keep their
        defaults. Each group checks itself; what depends on the shape is checked here."""
        groups = groups_of(options)
        formats, placement, launch = groups["formats"], groups["placement"], groups["launch"]
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
        if formats.dispatch_wire is not None:
            hidden_dim_scale, scale_dtype = _quantised_scales(formats.dispatch_wire, in_dtype, hidden_dim,
                                                              hidden_dim_scale, scale_dtype)
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
        if formats.scale_layout == "column" and hidden_dim_scale is None:
            raise InvalidArgument("scale_layout='column' needs scales (hidden_dim_scale)")
        if formats.combine_wire is not None and hidden_dim % C.COMBINE_BLOCK:
            raise InvalidArgument(f"combine_wire={formats.combine_wire!r} needs hidden_dim a multiple of "
                                  f"{C.COMBINE_BLOCK} (one scale per {C.COMBINE_BLOCK} values), got {hidden_dim}")
        if launch.max_sms is not None and C.BLOCKS_PER_SM * launch.max_sms < world_size:
            raise InvalidArgument(f"max_sms={launch.max_sms}: the kernels need a block per rank, "  # a block per
                                  f"{C.BLOCKS_PER_SM} per SM: at least {-(-world_size // C.BLOCKS_PER_SM)} SMs "
                                  f"at world size {world_size}")                     # source rank at least
        if placement.layout == "ranks":  # one row per received token, the worst case held
            given = [name for name, v in (("capacity", placement.capacity),
                                          ("slots_per_rank", placement.slots_per_rank),
                                          ("combine_wire", formats.combine_wire),
                                          ("group_by_source", placement.group_by_source or None),
                                          ("dp_size > 1", None if dp_size == 1 else dp_size)) if v is not None]
            if given:
                raise InvalidArgument(f"layout='ranks' takes no {', '.join(given)} (one row per received token, "
                                      f"grouped by source rank in token order, the worst case held)")
        slots = placement.slots_per_rank
        if slots is not None and slots < num_experts // world_size:
            raise InvalidArgument(f"slots_per_rank={slots} must be >= num_experts / world_size = "
                                  f"{num_experts // world_size} (every expert needs a slot)")
        if placement.capacity is not None:
            local = num_experts // world_size if slots is None else slots
            worst = max_num_tokens * (world_size // dp_size) * (min(k, local) if placement.layout == "packed"
                                                                  else 1)
            if placement.capacity > worst:
                raise InvalidArgument(f"capacity={placement.capacity} exceeds the worst case max_num_tokens * DP "
                                      f"groups = {worst} (leave it None for that)")
            if dp_size != 1:
                raise InvalidArgument("capacity: needs dp_size == 1 so far")
        return cls(world_size, rank, max_num_tokens, num_experts, k, hidden_dim, hidden_dim_scale, in_dtype, out_dtype,
                   scale_dtype, dp_size, **groups)

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
        every token of every DP group reaching min(top-k, local experts) of the rank's experts). Ranks layout:
        rows per rank, every token of every rank."""
        if self.capacity is not None:
            return self.capacity
        worst = self.max_num_tokens * self.num_dp_groups  # ranks layout: a row per source token
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
        if self.layout != "padded":
            return (self.expert_capacity, self.hidden_dim)
        return (self.num_local_experts, self.expert_capacity, self.hidden_dim)

    def expert_x_scale_shape(self):
        rows = (self.expert_capacity, self.hidden_dim_scale)
        rows = rows[::-1] if self.scale_layout == "column" else rows
        return rows if self.layout != "padded" else (self.num_local_experts, *rows)

    def key(self):
        """The fields that must be equal on every rank (every field but rank, each option by name); dtypes by
        name."""
        named = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rank" and f.name not in GROUPS}
        named.update((name, getattr(self, name)) for name in _GROUP_OF)
        return {name: str(v) if isinstance(v, np.dtype) else v for name, v in named.items()}
