"""Argument validation: every bad input raises a clear exception before anything is sent, and the next
valid call still works (single host rank, in process)."""
import dataclasses
import inspect
import re

import numpy as np
import pytest

import moecomm

E, K, H, S, M = 8, 2, 256, 2, 16


@pytest.fixture(scope="module")
def comm():
    c = moecomm.init(transport="host")
    yield c
    c.finalize()


def _good(dtype="float8_e4m3fn"):
    dt = moecomm.float8_e4m3fn if dtype == "float8_e4m3fn" else moecomm.bfloat16
    rng = np.random.default_rng(0)
    return dict(
        out_expert_num_tokens=np.zeros(E, np.int32),
        out_expert_x=np.zeros((E, M, H), dt),
        out_expert_x_scale=np.zeros((E, M, S), np.float32),
        dp_x=rng.standard_normal((M, H)).astype(dt),
        dp_x_scale=rng.random((M, S), np.float32),
        indices=np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32),
        bound_m=np.array([M], np.int32),
        weights=rng.random((M, K), np.float32))


@pytest.fixture
def a2a(comm):
    a = moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16")
    yield a
    a.destroy()


def _combine(a2a, args):
    y = args["out_expert_x"].astype(np.float32).astype(moecomm.bfloat16)
    out = np.zeros((M, H), moecomm.bfloat16)
    a2a.combine(out, args["indices"], None, y, args["bound_m"])
    return out


def _roundtrip(a2a, args):
    a2a.dispatch(**args)
    out = _combine(a2a, args)
    want = (args["dp_x"].astype(np.float32) * args["weights"].sum(1)[:, None]).astype(moecomm.bfloat16)
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -7, atol=1e-6)


def _readonly(a):
    a.flags.writeable = False
    return a


BAD_DISPATCH = {
    "dp_x dtype": (dict(dp_x=np.zeros((M, H), np.float32)), "dp_x: dtype float32"),
    "dp_x hidden": (dict(dp_x=np.zeros((M, H // 2), moecomm.float8_e4m3fn)), "dp_x: shape"),
    "too many rows": (dict(dp_x=np.zeros((M + 1, H), moecomm.float8_e4m3fn)), "at most max_num_tokens"),
    "indices dtype": (dict(indices=np.zeros((M, K), np.int16)), "expected int32, uint32 or int64"),
    "bound_m dtype": (dict(bound_m=np.array([M], np.int64)), "bound_m: dtype int64 does not match expected "
                      "int32 or uint32"),
    "expert id -2": (dict(indices=np.full((M, K), -2, np.int64)), "outside [0, 8) (-1: no expert)"),
    "indices k": (dict(indices=np.zeros((M, K + 1), np.int32)), "indices: shape"),
    "non-contiguous": (dict(out_expert_x=np.zeros((E, M, 2 * H), moecomm.float8_e4m3fn)[:, :, ::2]),
                       "C-contiguous"),
    "missing scale": (dict(out_expert_x_scale=None), "out_expert_x_scale: required"),
    "scale shape": (dict(dp_x_scale=np.zeros((M, S + 1), np.float32)), "dp_x_scale: shape"),
    "counts dtype": (dict(out_expert_num_tokens=np.zeros(E, np.int64)), "out_expert_num_tokens: dtype"),
    "bound_m shape": (dict(bound_m=np.array([M, 0], np.int32)), "bound_m: shape"),
    "list input": (dict(dp_x=[[0.0] * H] * M), "takes numpy arrays"),
    "m too large": (dict(bound_m=np.array([M + 1], np.int32)), "bound_m"),
    "bad expert": (dict(indices=np.full((M, K), E, np.int32)), "outside [0, 8)"),
    "weights rows < m": (dict(weights=np.zeros((M - 1, K), np.float32)), "bound_m=16 must be in [0, 15]"),
    "indices rows < m": (dict(indices=np.zeros((M - 4, K), np.int32)), "bound_m=16 must be in [0, 12]"),
    "read-only output": (dict(out_expert_x=_readonly(np.zeros((E, M, H), moecomm.float8_e4m3fn))), "read-only"),
    "repeated expert": (dict(indices=np.zeros((M, K), np.int32)), "more than once"),
}


@pytest.mark.parametrize("case", list(BAD_DISPATCH), ids=lambda c: c.replace(" ", "-"))
def test_bad_dispatch_then_good(a2a, case):
    change, message = BAD_DISPATCH[case]
    args = dict(_good(), **change)
    with pytest.raises((moecomm.InvalidArgument, moecomm.InvalidRouting), match=None) as e:
        a2a.dispatch(**args)
    assert message in str(e.value)
    _roundtrip(a2a, _good())


BAD_CONFIG = {
    "experts not divisible": (dict(num_experts=7), None),  # world 1 divides everything: see below
    "topk over 16": (dict(experts_per_token=17, num_experts=32), "experts_per_token=17"),
    "topk over experts": (dict(experts_per_token=9), "experts_per_token=9"),
    "too many experts": (dict(num_experts=1024), "num_experts=1024"),
    "hidden misaligned": (dict(hidden_dim=100), "multiple of 16 bytes"),
    "in dtype": (dict(in_dtype="float32"), "in_dtype: unsupported dtype"),
    "out dtype": (dict(out_dtype="float8_e4m3fn"), "out_dtype: unsupported dtype"),
    "scale dtype without scales": (dict(hidden_dim_scale=None, scale_dtype="float32"), "scale_dtype given"),
    "zero tokens": (dict(max_num_tokens=0), "max_num_tokens must be"),
    "dp size": (dict(dp_size=3), "dp_size=3"),
    "ue8m0 scales not a multiple of 4 bytes": (dict(hidden_dim_scale=3, scale_dtype="ue8m0"), "multiple of 4 bytes"),
    "scale layout": (dict(scale_layout="diagonal"), "scale_layout must be one of ['row', 'column']"),
    "column-major without scales": (dict(hidden_dim_scale=None, scale_layout="column"), "needs scales"),
    "combine wire": (dict(combine_wire="e5m2"), "combine_wire must be one of"),
    "combine wire, hidden not of 128": (dict(hidden_dim=64, hidden_dim_scale=None, combine_wire="e4m3"),
                                        "multiple of 128"),
    "dispatch wire": (dict(in_dtype="bf16", hidden_dim_scale=None, dispatch_wire="e5m2"),
                      "dispatch_wire must be one of"),
    "dispatch wire of fp8 tokens": (dict(hidden_dim_scale=None, dispatch_wire="e4m3"), "quantises bfloat16 or float16"),
    "dispatch wire, hidden not of 128": (dict(in_dtype="bf16", hidden_dim=64, hidden_dim_scale=None,
                                              dispatch_wire="e4m3"), "multiple of 128"),
    "dispatch wire e4m3 with UE8M0 scales": (dict(in_dtype="bf16", hidden_dim=256, hidden_dim_scale=None,
                                                  scale_dtype="ue8m0", dispatch_wire="e4m3"), "scale_dtype"),
    "dispatch wire, scales per token given wrong": (dict(in_dtype="bf16", hidden_dim=256, hidden_dim_scale=4,
                                                         dispatch_wire="e4m3"), "leave it None"),
    "dispatch wire, packed UE8M0 of 2 blocks": (dict(in_dtype="bf16", hidden_dim=256, hidden_dim_scale=None,
                                                     scale_dtype="ue8m0x4", dispatch_wire="e4m3_ue8m0"),
                                                "not a multiple of 4"),
    "every format on one rank": (dict(in_dtype="uint8", hidden_dim_scale=4, scale_dtype="ue8m0x4",
                                      scale_layout="column", combine_wire="e4m3_ue8m0", hidden_dim=256), None),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG), ids=lambda c: c.replace(" ", "-"))
def test_bad_config(comm, case):
    change, message = BAD_CONFIG[case]
    args = dict(dict(max_num_tokens=M, num_experts=E, experts_per_token=K, hidden_dim=H, hidden_dim_scale=S,
                     in_dtype="float8_e4m3fn", out_dtype="bfloat16", dp_size=1), **change)
    if message is None:  # accepted on one rank
        moecomm.AllToAll(comm, **args).destroy()
        return
    with pytest.raises(moecomm.InvalidArgument) as e:
        moecomm.AllToAll(comm, **args)
    assert message in str(e.value)


def test_the_alltoall_options_are_defined_once():
    """AllToAll's options are defined once, as the fields of its option groups: AllToAll and create() take them as
    ``**options`` (fields by name, or a group as itself or a dict; an unknown name, or a group given both ways, is
    refused); AllToAll's own parameters are AllToAllConfig's shape fields (but world_size and rank, the
    communicator's) plus comm and timeout; docs/api.md's table of AllToAll's arguments names each parameter and
    option once, and each group."""
    from moecomm._config import _GROUP_OF, GROUPS, AllToAllConfig
    own = {"comm", "timeout"}
    options = set(_GROUP_OF)  # every group's fields
    core = [f.name for f in dataclasses.fields(AllToAllConfig) if f.name not in GROUPS][2:]  # not world, rank
    for fn in (moecomm.AllToAll.__init__, AllToAllConfig.create):
        params = inspect.signature(fn).parameters
        named = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD and n not in {"self", "cls"}]
        assert [n for n in named if n not in own | {"world_size", "rank"}] == core, fn
        assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD, fn
    args = (1, 0, M, E, K, H, S, "float8_e4m3fn", "bfloat16", None, 1)
    with pytest.raises(moecomm.InvalidArgument, match="unknown option.*capcity"):
        AllToAllConfig.create(*args, capcity=4)
    flat, grouped, as_dict = (AllToAllConfig.create(*args, **kw) for kw in (
        dict(capacity=4, telemetry_window=8), dict(placement=moecomm.Placement(capacity=4),
                                                   telemetry=moecomm.Telemetry(telemetry_window=8)),
        dict(placement={"capacity": 4}, telemetry={"telemetry_window": 8})))
    assert flat == grouped == as_dict and flat.capacity == flat.placement.capacity == 4
    with pytest.raises(moecomm.InvalidArgument, match="capacity: given both as keywords and in placement="):
        AllToAllConfig.create(*args, capacity=4, placement={"layout": "packed"})
    with pytest.raises(moecomm.InvalidArgument, match="placement: its fields are"):
        AllToAllConfig.create(*args, placement={"capcity": 4})
    from conftest import ROOT
    api = (ROOT / "docs" / "api.md").read_text()
    table = api[api.index("| argument | meaning |", api.index("## `moecomm.AllToAll`")):]
    table = table[:table.index("\n\n")]
    documented = [n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split(" | ")[0])]
    assert sorted(documented) == sorted(set(core) | own - {"comm"} | set(options) | set(GROUPS))


def test_finalize_ends_its_alltoalls():
    """finalize() without destroy(): the AllToAll is destroyed with its communicator and says so."""
    c = moecomm.init(transport="host")
    a = moecomm.AllToAll(c, M, E, K, H, S, "float8_e4m3fn", "bfloat16")
    c.finalize()
    with pytest.raises(moecomm.InvalidArgument, match="destroyed .its communicator was finalized"):
        a.dispatch(**_good())
    a.destroy()  # still safe


def test_load_tool_ends_on_one_process(tmp_path):
    """The mask scenario needs a second rank: on one process it says so instead of waiting for itself."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "moecomm.loadtest", "--scenarios", "mask", "--steps", "6", "--tokens",
                        "8", "--experts", "8", "--topk", "2", "--hidden", "64", "--json", str(tmp_path / "l.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "needs at least 2 ranks" in p.stdout, p.stdout + p.stderr


def test_combine_needs_weights_and_dispatch(comm):
    a = moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16")
    args = _good()
    out = np.zeros((M, H), moecomm.bfloat16)
    y = np.zeros((E, M, H), moecomm.bfloat16)
    with pytest.raises(moecomm.InvalidArgument, match="no dispatch"):
        a.combine(out, args["indices"], None, y, args["bound_m"])
    a.dispatch(**dict(args, weights=None))
    with pytest.raises(moecomm.InvalidArgument, match="weights=None needs"):
        a.combine(out, args["indices"], None, y, args["bound_m"])
    with pytest.raises(moecomm.InvalidArgument, match="no dispatch"):  # the refused combine ended the call
        a.combine(out, args["indices"], args["weights"], y, args["bound_m"])
    a.dispatch(**dict(args, weights=None))
    a.combine(out, args["indices"], args["weights"], y, args["bound_m"])
    a.destroy()
    a.destroy()  # twice is fine
    with pytest.raises(moecomm.InvalidArgument, match="destroyed"):
        a.dispatch(**args)


def test_split_send_recv_order(a2a):
    """A refused half ends the call it belongs to (the next call when none is in progress); a dispatch send
    that finds a call in progress ends it (saying so) and runs as the next call."""
    args = _good()
    with pytest.raises(moecomm.InvalidArgument, match="without a prior do_send"):
        a2a.dispatch(**args, do_send=False)
    with pytest.raises(moecomm.InvalidArgument, match="both False"):
        a2a.dispatch(**args, do_send=False, do_recv=False)
    a2a.dispatch(**args, do_recv=False)
    with pytest.warns(RuntimeWarning, match="was not finished"):
        a2a.dispatch(**args, do_recv=False)
    with pytest.raises(moecomm.InvalidArgument, match="other output arrays than the send half"):
        a2a.dispatch(**dict(args, out_expert_x=args["out_expert_x"].copy()), do_send=False)
    with pytest.raises(moecomm.InvalidArgument, match="without a prior do_send"):  # that call is over
        a2a.dispatch(**args, do_send=False)
    a2a.dispatch(**args, do_recv=False)
    a2a.dispatch(**args, do_send=False)
    _combine(a2a, args)
    _roundtrip(a2a, _good())


def test_each_dispatch_has_one_combine(a2a):
    args = _good()
    with pytest.raises(moecomm.InvalidArgument, match="no dispatch to combine"):
        _combine(a2a, args)
    a2a.dispatch(**args, do_recv=False)
    with pytest.raises(moecomm.InvalidArgument, match="receive half has not run yet"):
        _combine(a2a, args)  # refused: it ends the call
    with pytest.raises(moecomm.InvalidArgument, match="without a prior do_send"):
        a2a.dispatch(**args, do_send=False)
    a2a.dispatch(**args)
    with pytest.warns(RuntimeWarning, match="was not finished"):
        a2a.dispatch(**args)  # it ends the call whose combine was due, then runs as the next
    _combine(a2a, args)
    _roundtrip(a2a, _good())


def test_abort_ends_the_call_in_progress(a2a):
    args = _good()
    a2a.abort()  # between calls: nothing to do
    a2a.dispatch(**args)
    a2a.abort()
    with pytest.raises(moecomm.InvalidArgument, match="no dispatch to combine"):
        _combine(a2a, args)
    a2a.dispatch(**args, do_recv=False)
    a2a.abort()
    _roundtrip(a2a, _good())


def test_dtype_names(comm):
    for name in ("bf16", "bfloat16", moecomm.bfloat16, "fp16", np.float16, "e4m3", "float8_e4m3fn"):
        moecomm.AllToAll(comm, M, E, K, H, None, name, "fp16").destroy()


def test_symmetric_memory_needs_gpu_transport(comm):
    with pytest.raises(moecomm.InvalidArgument, match="needs a GPU transport"):
        comm.symmetric((4,), np.float32)


def test_unknown_transport():
    with pytest.raises(moecomm.InvalidArgument, match="transport must be one of"):
        moecomm.init(transport="ucx")


def test_symmetric_memory_formula_r1():
    """DeepSeek-R1 sizes: the symmetric memory per rank stays under 1 GiB at 128 tokens (EP2 and EP8)."""
    from moecomm._config import AllToAllConfig
    from moecomm.transport.gpu_alltoall import record_bytes, symmetric_bytes
    for world in (2, 8):
        c = AllToAllConfig.create(world, 0, 128, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1)
        assert record_bytes(c) == 7168 + 224 + 80
        assert symmetric_bytes(c) < 2 ** 30


def test_dispatch_streams_only_prefill_sized_batches():
    """The one-launch dispatch splits its grid into senders and early receivers, records carry arrival
    words, and the streamed kernel runs, only where a sending block can hold more than STREAM_TOKENS tokens
    (R1 shapes, EP2, 132 SMs)."""
    from moecomm import _constants as C
    from moecomm._config import AllToAllConfig
    from moecomm.transport.gpu_plan import launch_plan
    for tokens, streams in ((1, False), (128, False), (1024, False), (4096, True)):
        c = AllToAllConfig.create(2, 0, tokens, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1)
        plan = launch_plan(c, 132, "ipc")
        dispatch = "moecomm_dispatch_streamed" if streams else "moecomm_dispatch"
        assert plan.streamed == streams
        assert plan.whole == {"dispatch": (dispatch,), "combine": ("moecomm_combine",)} and not plan.fallback
        grid, senders = plan.grids[dispatch], plan.senders
        assert senders == (grid * C.SEND_SHARE // 100 if streams else grid)
        if streams:
            assert tokens > C.STREAM_TOKENS * senders



def test_world_size_1_takes_the_local_path_in_the_padded_layout():
    """At world size 1 the phases in one launch are the local path's kernels (cuda/local.cu), at every batch
    size; the packed layout keeps the general kernels, the ranks layout the general dispatch beside the local
    combine, and the FP8 combine wire its own combine (its dispatch is local); at world size 2 nothing is local."""
    from moecomm._config import AllToAllConfig
    from moecomm.transport import gpu_plan as P

    def cfg(world, tokens, **kw):
        return AllToAllConfig.create(world, 0, tokens, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1, **kw)

    def whole(c, sms=132):
        return {phase: kernels[0] for phase, kernels in P.launch_plan(c, sms, "ipc").whole.items()}
    for tokens in (1, 128, 264, 265, 4096):
        assert P.local(cfg(1, tokens))
        # a block per token up to 2 per SM (264 on 132 SMs): the small batches' dispatch
        small = dict(P.LOCAL_KERNELS, dispatch=P.LOCAL_TOKENS)
        assert whole(cfg(1, tokens)) == (small if tokens <= 264 else P.LOCAL_KERNELS)
        assert not P.local(cfg(2, tokens))
    assert whole(cfg(1, 128), 44) == P.LOCAL_KERNELS  # 88 blocks: some have two tokens
    assert not P.local(cfg(1, 128, layout="packed"))
    assert whole(cfg(1, 128, layout="packed")) == P.WHOLE_KERNELS
    # the ranks layout combines each token's one row in place; its dispatch, and the packed layout's, never
    # stream at world size 1 (the own records carry no row: nothing lands early)
    ranks = cfg(1, 4096, layout="ranks")
    assert whole(ranks) == dict(P.WHOLE_KERNELS, combine=P.LOCAL_KERNELS["combine"])
    assert not P.streamed(ranks, 132) and not P.streamed(cfg(1, 4096, layout="packed"), 132)
    assert P.streamed(cfg(2, 4096, layout="ranks"), 132)
    assert whole(cfg(2, 128, layout="ranks"))["combine"] == P.WHOLE_KERNELS["combine"]
    assert whole(cfg(1, 128, combine_wire="e4m3")) == {"dispatch": P.LOCAL_TOKENS, "combine": "moecomm_combine_wire"}


def test_the_small_batches_local_dispatch_writes_the_sources_itself():
    """A whole dispatch given sources (AllToAll.dispatch(sources=...)) writes them in its own launch where it is
    the local path's small-batch kernel (LOCAL_TOKENS); elsewhere (a block with several tokens, world size 2)
    the source layout's kernel runs after it; an AllToAll without a source layout has neither."""
    from moecomm._config import AllToAllConfig
    from moecomm.transport import gpu_plan as P

    def plan(world, tokens, sms=132, **kw):
        c = AllToAllConfig.create(world, 0, tokens, 288, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1, **kw)
        return P.launch_plan(c, sms, "ipc")
    assert plan(1, 128).dispatch_sources and plan(1, 128, group_by_source=True).dispatch_sources
    assert plan(1, 128).summary()["dispatch_sources"]
    assert not plan(1, 128, 44).dispatch_sources and P.SOURCE_LAYOUT in plan(1, 128, 44).grids  # 88 blocks
    assert not plan(1, 4096).dispatch_sources
    by_source = plan(2, 128, group_by_source=True)
    assert not by_source.dispatch_sources and P.SOURCE_LAYOUT in by_source.grids
    assert not plan(2, 128).dispatch_sources and P.SOURCE_LAYOUT not in plan(2, 128).grids


def test_small_batches_spread_over_the_grid_at_world_size_1():
    """The local path's small-batch dispatch gives a token up to top-k blocks while the grid fills at most half
    of 2 per SM (one where pairs may be dropped for capacity: a token's drop word is one block's), and its
    combine a block per (token, slice of 64 chunks) up to 2 per SM (R1 shapes: 7168 values, 14 slices; 132 SMs)."""
    from moecomm._config import AllToAllConfig
    from moecomm.transport.gpu_plan import GRIDS, LOCAL_TOKENS

    def grids(tokens, **kw):
        c = AllToAllConfig.create(1, 0, tokens, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1, **kw)
        return GRIDS[LOCAL_TOKENS](c, 132), GRIDS["moecomm_combine_local"](c, 132)
    assert grids(1) == (8, 14)
    assert grids(16) == (128, 224)
    assert grids(64) == (128, 264)
    assert grids(128) == (128, 264)
    assert grids(16, capacity=4, overflow="drop") == (16, 224)
    assert grids(16, capacity=4) == (128, 224)  # overflow="error": nothing drops


def _r1_cfg(tokens, dp=1, layout="padded"):
    from moecomm._config import AllToAllConfig
    return AllToAllConfig.create(2 * dp, 0, tokens, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, dp,
                                 layout=layout)


def test_prefill_sizes_of_a_mapped_group_run_the_put_free_twin(monkeypatch):
    """The launch plan's module: an NVSHMEM group whose every peer is mapped runs the ipc build (no puts, the
    streamed combine) at prefill-sized batches; smaller batches, a group with a network peer (or forced puts)
    and the ipc transport run the transport's own module."""
    from moecomm import _constants as C
    from moecomm.transport.gpu import maps_every_peer
    from moecomm.transport.gpu_plan import launch_plan

    def pick(variant, tokens, mapped):
        return launch_plan(_r1_cfg(tokens), 132, variant, mapped).variant
    assert pick("nvshmem", 4096, True) == "ipc"
    assert pick("nvshmem", 4096, False) == "nvshmem"
    assert pick("nvshmem", 1024, True) == "nvshmem"
    assert pick("ipc", 4096, True) == "ipc"

    monkeypatch.delenv(C.FORCE_PUTS_ENV, raising=False)
    assert maps_every_peer([0, 1 << 30]) and not maps_every_peer([0, C.PEER_UNMAPPED])
    monkeypatch.setenv(C.FORCE_PUTS_ENV, "1")
    assert not maps_every_peer([0, 1 << 30])


def test_combine_streams_at_prefill_sizes_in_dp1_padded_where_the_kernels_carry_it():
    """The streamed one-launch combine (own partial sums never formed): prefill-sized batches, DP size 1, the
    padded layout, and a module whose kernels carry it (ipc, not nvshmem: compiled out there; an NVSHMEM group
    with every peer mapped runs the ipc build there)."""
    from moecomm import _jit
    from moecomm.transport.gpu_plan import launch_plan

    def streams(c, variant="ipc", mapped=True):
        return launch_plan(c, 132, variant, mapped).combine_streams
    cfg = _r1_cfg
    assert "-DMOECOMM_STREAMS_COMBINE=0" in _jit._compile_flags("sm_90", "nvshmem")
    assert "-DMOECOMM_STREAMS_COMBINE=1" in _jit._compile_flags("sm_90", "ipc")
    assert streams(cfg(4096)) and streams(cfg(4096), "nvshmem")
    assert not streams(cfg(4096), "nvshmem", mapped=False)
    assert not streams(cfg(1024))
    assert not streams(cfg(8192, dp=2))
    assert not streams(cfg(4096, layout="packed"))


class Loopback(moecomm.Bootstrap):
    """A one-rank bootstrap: what a custom runtime implements."""
    def allgather(self, data, timeout_s, what):
        return [bytes(data)]


def test_bootstrap_of_each_kind():
    from mpi4py import MPI
    from moecomm.comm import MpiBootstrap, bootstrap_of
    b = Loopback()
    assert bootstrap_of(b, 5) is b
    for comm in (MPI.COMM_WORLD, None):  # a duplicate of MPI's communicator: moecomm's messages stay on it
        boot = bootstrap_of(comm, 5)
        assert isinstance(boot, MpiBootstrap) and boot.owned
        assert MPI.Comm.Compare(boot.mpi, MPI.COMM_WORLD) == MPI.CONGRUENT
        boot.close(collective=True)
    with pytest.raises(moecomm.InvalidArgument, match="comm: expected an mpi4py communicator"):
        bootstrap_of(object(), 5)


def test_host_transport_needs_mpi():
    with pytest.raises(moecomm.InvalidArgument, match="host transport moves data over MPI"):
        moecomm.init(comm=Loopback(), transport="host")


def test_device_error_words_map_to_the_host_transports_errors():
    """The GPU error word (code, peer, phase, detail, call, amount) becomes the exception the host transport
    raises for the same fault, naming the rank, the refused argument, the expert and its demand, the call."""
    from moecomm import _constants as C
    from moecomm.transport.gpu import error_from_words
    refused = C.ERR_REFUSED | C.ARGUMENTS.index("indices") << C.REASON_ARG_SHIFT
    e = error_from_words([C.ERR_PEER, 1, C.PHASE_DISPATCH, refused, 12, 0], "AllToAll")
    assert isinstance(e, moecomm.PeerError) and e.peer == 1 and "refused indices" in str(e) and "call 12" in str(e)
    e = error_from_words([C.ERR_PEER, 2, C.PHASE_DISPATCH, C.ERR_BAD_EXPERT, 3, 0], "AllToAll")
    assert isinstance(e, moecomm.InvalidRouting) and "rank 2: invalid expert ids" in str(e)
    e = error_from_words([C.ERR_PEER, 0, C.PHASE_COMBINE, C.ERR_M_DIFFERS, 3, 0], "AllToAll")
    assert isinstance(e, moecomm.PeerError) and "differs" in e.reason
    e = error_from_words([C.ERR_M_DIFFERS, 0, C.PHASE_COMBINE, 7, 3, 0], "AllToAll")
    assert isinstance(e, moecomm.InvalidArgument) and "bound_m=7" in str(e)
    e = error_from_words([C.ERR_TIMEOUT, 1, C.PHASE_COMBINE, 0, 4, 0], "AllToAll")
    assert isinstance(e, moecomm.CommTimeout) and e.peer == 1 and e.phase == "combine"
    e = error_from_words([C.ERR_CAPACITY, 0, C.PHASE_DISPATCH, 5, 4, 31], "AllToAll", capacity=6)
    assert isinstance(e, moecomm.CapacityExceeded) and (e.expert, e.demand, e.capacity) == (5, 31, 6)
    over = C.ERR_CAPACITY | (5 + 1) << C.REASON_ARG_SHIFT  # a peer's flag: expert + 1, the demand beside it
    e = error_from_words([C.ERR_PEER, 1, C.PHASE_COMBINE, over, 4, 31], "AllToAll", capacity=6)
    assert isinstance(e, moecomm.CapacityExceeded) and (e.expert, e.demand) == (5, 31) and "rank 1" in str(e)
    e = error_from_words([C.ERR_GENERATION, 1, C.PHASE_DISPATCH, 3, 4, 2], "AllToAll")
    assert isinstance(e, moecomm.ExpertMapMismatch) and "generation 3" in str(e)


@pytest.mark.parametrize("kwargs, why", [
    (dict(capacity=M + 1), "exceeds the worst case"),
    (dict(capacity=0), "capacity must be an integer >= 1"),
    (dict(capacity=4, overflow="spill"), "overflow must be one of"),
    (dict(capacity=4, dp_size=1, slots_per_rank=E - 1), "slots_per_rank=7 must be >="),
    (dict(layout="ragged"), "layout must be one of"),
    (dict(layout="packed", capacity=M * K + 1), "exceeds the worst case"),
])
def test_capacity_and_slots_are_checked(comm, kwargs, why):
    with pytest.raises(moecomm.InvalidArgument, match=why):
        moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16", **kwargs)


def test_offsets_go_with_the_packed_and_ranks_layouts(comm):
    args = _good()
    padded = moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16")
    with pytest.raises(moecomm.InvalidArgument, match="out_expert_offsets: not for the padded layout"):
        padded.dispatch(**args, out_expert_offsets=np.zeros(E + 1, np.int32))
    padded.destroy()
    packed = moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16", layout="packed")
    rows = packed.cfg.expert_capacity
    assert rows == M * K and packed.cfg.expert_x_shape() == (M * K, H)
    args.update(out_expert_x=np.zeros((rows, H), moecomm.float8_e4m3fn),
                out_expert_x_scale=np.zeros((rows, S), np.float32))
    with pytest.raises(moecomm.InvalidArgument, match="out_expert_offsets: required by the packed layout"):
        packed.dispatch(**args)
    offsets = np.zeros(E + 1, np.int32)
    packed.dispatch(**args, out_expert_offsets=offsets)
    assert offsets[-1] == int((args["indices"] >= 0).sum()) == args["out_expert_num_tokens"].sum()
    packed.combine(np.zeros((M, H), moecomm.bfloat16), args["indices"], None,
                   args["out_expert_x"].astype(np.float32).astype(moecomm.bfloat16), args["bound_m"])
    packed.destroy()
    ranks = moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16", layout="ranks")
    rows = M * comm.world_size  # a row per token of every rank
    assert ranks.cfg.expert_x_shape() == (rows, H)
    args.update(out_expert_x=np.zeros((rows, H), moecomm.float8_e4m3fn),
                out_expert_x_scale=np.zeros((rows, S), np.float32))
    with pytest.raises(moecomm.InvalidArgument, match="out_expert_offsets: required by the ranks layout"):
        ranks.dispatch(**args)
    with pytest.raises(moecomm.InvalidArgument, match=r"out_expert_offsets: shape \(9,\) does not match expected "
                                                      r"\(2,\)"):
        ranks.dispatch(**args, out_expert_offsets=offsets)  # [world_size + 1]: the first row of each source
    ranks.destroy()


def test_combine_rows_on_the_fp8_wire_are_about_half_the_bf16_bytes():
    """The bytes of one combine row as the GPU kernels send it (moecomm._abi.combine_row_bytes): hidden_dim
    values of out_dtype, or e4m3 values and a scale per 128 of them (float32 or one UE8M0 byte), padded to 16."""
    from moecomm._abi import combine_row_bytes
    from moecomm._config import AllToAllConfig

    def row(wire):
        return combine_row_bytes(AllToAllConfig.create(1, 0, M, E, K, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1,
                                                       combine_wire=wire))
    assert (row(None), row("e4m3"), row("e4m3_ue8m0")) == (7168 * 2, 7168 + 56 * 4, 7168 + 64)


def test_max_sms_caps_every_grid_and_is_checked():
    """AllToAll(max_sms=n): every kernel's grid is sized for n SMs (at most BLOCKS_PER_SM * n blocks); the
    symmetric staging shrinks with it; n must be a positive integer."""
    from moecomm import _constants as C
    from moecomm._config import AllToAllConfig
    from moecomm.transport.gpu_alltoall import symmetric_bytes
    from moecomm.transport.gpu_plan import launch_plan, sm_budget
    full, capped = (AllToAllConfig.create(1, 0, 4096, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1,
                                          max_sms=n) for n in (None, 44))
    grids = {n: launch_plan(c, 132, "ipc").grids for n, c in ((None, full), (44, capped))}
    assert set(grids[None].values()) == {C.BLOCKS_PER_SM * 132, 1}  # 1: the source layout's block
    assert set(grids[44].values()) == {C.BLOCKS_PER_SM * 44, 1}
    assert symmetric_bytes(capped) < symmetric_bytes(full)
    assert sm_budget(capped, 16) == 16  # never more than the GPU has
    for bad in (0, -1, 2.5, True):
        with pytest.raises(moecomm.InvalidArgument, match="max_sms"):
            AllToAllConfig.create(1, 0, 128, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1, max_sms=bad)
    with pytest.raises(moecomm.InvalidArgument, match="max_sms=3: .* at least 4 SMs at world size 8"):
        AllToAllConfig.create(8, 0, 128, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1, max_sms=3)
    AllToAllConfig.create(8, 0, 128, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1, max_sms=4)


def test_gradients_option_sizes_the_gradient_rows_and_is_in_the_key(comm):
    """AllToAll(gradients=True): GPU transports add world * max_num_tokens gradient rows of
    grad_row_bytes (float32 values, the weights, a trailer) and their words, and stage rows big enough for
    one; the option is in the key every rank must pass alike; the host transport computes gradients
    either way."""
    from moecomm import _abi
    from moecomm._config import AllToAllConfig
    from moecomm.transport.gpu_alltoall import symmetric_sizes
    from moecomm.transport.gpu_plan import launch_plan
    off, on = (AllToAllConfig.create(2, 0, 128, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1,
                                     gradients=g) for g in (False, True))
    assert _abi.grad_row_bytes(on) == 4 * 7168 + 32 + 16
    a, b = (symmetric_sizes(c, launch_plan(c, 132, "ipc")) for c in (off, on))
    assert (a["grad_buf"], a["grad_words"]) == (0, 0)
    assert b["grad_buf"] == 2 * 128 * _abi.grad_row_bytes(on) and b["grad_words"] == (3 * 2 + 128 * 8) * 8
    assert b["stage_row"] >= _abi.grad_row_bytes(on) > a["stage_row"]
    assert off.key()["gradients"] is False and on.key()["gradients"] is True
    a2a = moecomm.AllToAll(comm, 8, 4, 2, 16)  # gradients=False: the host transport computes them anyway
    assert a2a.gradients
    a2a.destroy()


@pytest.mark.parametrize("option", [dict(num_tags=4), dict(score_gap=True), dict(timing=True)],
                         ids=["num_tags", "score_gap", "timing"])
def test_what_the_telemetry_window_keeps_is_refused_without_one(comm, option):
    """num_tags, score_gap and timing are kept per call in the telemetry window: with telemetry_window=0 they would
    count nothing, so the contradiction is refused (it was accepted silently)."""
    with pytest.raises(moecomm.InvalidArgument, match="telemetry_window=0 turns off"):
        moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16", telemetry_window=0, **option)
    moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16", telemetry_window=8, **option).destroy()
