#!/usr/bin/env bash
# Build, test (and optionally benchmark) on the GPU machine in one go. Run from the repo root:
#   bash tools/gpu_check.sh          build, peer check, quick sweep, embedding, timeout, demo, full sweep
#   bash tools/gpu_check.sh quick    the same without the full sweep, then the put-only path and a short
#                                    R1-decode benchmark (host time per call included)
#   bash tools/gpu_check.sh peer     build and peer check only
#   bash tools/gpu_check.sh bench    build, checks, world size 1, put-only path, R1-sized sweep, benchmark
#   bash tools/gpu_check.sh profile  build, short benchmark (per-phase graphs), Nsight Compute at world
#                                    size 1 (all sections) and on every rank (kernel durations), quick sweep
#   bash tools/gpu_check.sh faults   build, peer check, collective errors, masking, a rank stalled at each
#                                    point of a run, a soak with injected faults ($SOAK_MINUTES, default 2)
#   bash tools/gpu_check.sh skew     build, peer check; on both transports telemetry, capacity policies and
#                                    expert maps (also through NVSHMEM puts); control, quick sweep, embedding
#   bash tools/gpu_check.sh skew-quick  capacity policies and the packed layout on both transports,
#                                    examples/routing_telemetry.py,
#                                    the load tool with one rank per EP group (--ep-size 1), and at 4
#                                    ranks time-sliced over ipc its tp and owners scenarios
#   bash tools/gpu_check.sh skew-bench  build, peer check, the benchmark with telemetry off / on / timing,
#                                    the packed layout and tags + score gap (R1 decode and prefill), the load tool at
#                                    EP<GPUs> (R1 sizes)
#   bash tools/gpu_check.sh transports  both GPU transports: the ipc transport through the quick sweep,
#                                    control, masking, timeout, embedding, examples and demo; the nvshmem
#                                    quick sweep; the benchmark on each and the two joined (bench-both.json)
#   bash tools/gpu_check.sh bench-both  the benchmark on each transport and the two joined, nothing else
#   bash tools/gpu_check.sh floors   build, peer check, then the floors the phases are measured against: HBM
#                                    rates of R1-prefill's memory patterns (tools/hbm_floor.py) and two bare
#                                    exchanges of a small batch's rows on each transport (tools/exchange_floor.py)
#   bash tools/gpu_check.sh ranks    world size 1 on both transports (the local path: model sizes, control),
#                                    then more ranks than GPUs: 2, 4 and 8 ranks
#                                    time-sliced on GPU 0 over ipc (correct and slow): quick sweeps,
#                                    control, the JAX matrix, telemetry, capacity, packed, replicas, masking, DP
#                                    groups, a rank whose program fails
#   bash tools/gpu_check.sh grads    gradients: the GPU suite's runs of tests/mpi_backward.py (1 rank on both
#                                    transports and the put path, 2 and 4 ranks time-sliced over ipc) and of the JAX
#                                    and PyTorch layers' gradients, then tools/grad_bench.py at world size 1, and on
#                                    every GPU where there are several (GRAD_BENCH= skips it; GRAD_NCU=1 adds Nsight
#                                    Compute of every kernel of one eager pass at R1-decode)
#   bash tools/gpu_check.sh formats  the formats of the wire (the GPU suite's tests/mpi_formats.py runs: scale dtypes
#                                    and layouts, opaque rows, the FP8 combine wire; at world size 1 on both
#                                    transports, at 2 and 4 ranks time-sliced over ipc), then R1-decode at world size
#                                    1 with combine's rows as bf16, e4m3 and e4m3_ue8m0 (bench JSON each); with
#                                    $BASELINE (a tree of an earlier commit) the same bf16 benchmark from that tree,
#                                    run in turn with ours
#   bash tools/gpu_check.sh host     the eager call path at world size 1 over ipc: the quick sweep, each step of
#                                    a call timed alone (tools/host_profile.py --parts), the JAX layer's host time
#                                    (tools/jax_host.py --parts) and, with $BASELINE (a tree of an earlier
#                                    commit), tools/host_ab.py against it ($ROUNDS rounds)
#   bash tools/gpu_check.sh ab       a kernel change's A/B: with $BASELINE (a tree of the commit before it),
#                                    R1-decode, V2-Lite, 1 and 16 tokens ($AB_CONFIGS) at world size 1 over ipc,
#                                    the baseline's tree then this one, $ROUNDS rounds (default 2; bench JSON
#                                    each); several trees in $BASELINE (a bisect) run in turn, each its own JSON
#   bash tools/gpu_check.sh recovery a failed call on one rank fails on every rank and no step gets another's
#                                    data: the GPU suite's runs of tests/mpi_recovery.py, mpi_control.py (with
#                                    calls replayed from CUDA graphs out of order), mpi_call_ids.py (a rank
#                                    skipping a numbered call, eager and under jitted lax.cond), mpi_threads.py
#                                    (two threads a rank) and quick sweeps, at 1 rank on both transports and 2, 4
#                                    (and 8) ranks time-sliced on GPU 0 over ipc; the exit cases, then a soak with
#                                    every fault kind at 2 ranks ($SOAK_MINUTES, default 5)
#   bash tools/gpu_check.sh jax      moecomm.jax on one GPU, the GPU suite's runs of tests/mpi_jax.py,
#                                    mpi_jax_grad.py, mpi_jax_spmd.py (the SPMD form) and mpi_jax_errors.py (faults in
#                                    replayed steps; a silent rank at 2) at 1, 2 and 4 ranks, and of tools/jax_step.py
#                                    --small --require-captured (every layer and form, no Python per call;
#                                    preallocation off and on), then tools/jax_step.py (jitted 8-layer steps of every
#                                    layer against the same calls in a CUDA graph and XLA alone; $OUT/jax-step.json)
#   bash tools/gpu_check.sh deep-ep  moecomm.compat.deep_ep: the GPU suite's runs of tests/mpi_deep_ep.py and
#                                    mpi_deep_ep_normal.py (1 rank on both transports, 2 (and 4) ranks over ipc)
#                                    and of tools/deep_ep_bench.py; with $DEEPEP_TESTS (DeepEP's tests/ folder,
#                                    fetched, never committed) its own test_low_latency.py and test_intranode.py
#                                    unchanged at ${DEEPEP_RANKS:-1 2 4} ranks, their timings included, `import
#                                    deep_ep` answered by moecomm.compat.deep_ep (ranks sharing a GPU:
#                                    tests/deep_ep_shared_gpu.py)
#   bash tools/gpu_check.sh --help   this text
#   bash tools/gpu_check.sh latency  the checks a kernel change needs (quick sweeps on both transports, the
#                                    put-only path, world size 1, the model-sized and streamed cases (--full),
#                                    capacity, packed, replicas, telemetry, capacity and a skipped dispatch or
#                                    combine at a prefill size, masking, control, embedding), then the kernels'
#                                    stage trace (tools/trace_kernels.py, MOECOMM_TRACE=1 builds) at 1 and 128
#                                    tokens
# Every mode runs its test programs through the GPU suite (python -m pytest tests/test_gpu.py -k ...: the suite()
# helper below), beside its benchmarks and tools (which it runs directly).
# GPU transport: $MOECOMM_TRANSPORT (nvshmem by default here; ipc for the CUDA-IPC transport). Wheels the GPU
# machine lacks (nvshmem4py) are installed from .whl/ when present. Logs go to $OUT if set. Launcher: mpirun or
# mpiexec from PATH, Open MPI (root: --allow-run-as-root) or MPICH (which passes the environment itself).
set -u -o pipefail
case "${1:-}" in -h|--help|help) sed -n '2,/^# GPU transport/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;; esac
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$ngpu" -lt 1 ]; then
  echo "gpu_check.sh: no GPU visible (nvidia-smi -L lists none); it runs the GPU checks. The CPU tests: python -m pytest -q tests" >&2
  exit 2
fi
launcher=$(basename "$(command -v mpirun || command -v mpiexec)") || { echo "gpu_check.sh: needs mpirun or mpiexec on PATH" >&2; exit 2; }
# one command line for either MPI: Open MPI exports the variables named by -x; MPICH passes the whole
# environment and knows no -x, so a small wrapper drops those pairs. The launcher is called by name: Open MPI
# called by its absolute path puts its own bin/ first on the ranks' PATH (another python3)
wrapper=/tmp/moecomm-mpirun
if "$launcher" --version 2>&1 | grep -q "Open MPI\|OpenRTE"; then
  printf '#!/usr/bin/env bash\nexec %q --oversubscribe %s "$@"\n' "$launcher" "$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)" > "$wrapper"
else
  printf '#!/usr/bin/env bash\na=(); while [ $# -gt 0 ]; do if [ "$1" = -x ]; then shift 2; else a+=("$1"); shift; fi; done\nexec %q "${a[@]}"\n' "$launcher" > "$wrapper"
fi
chmod +x "$wrapper"
out=${OUT:-/tmp/moecomm-out}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared machines; one node: no network transport, bootstrap over loopback.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export MOECOMM_CACHE_DIR=${MOECOMM_CACHE_DIR:-/tmp/moecomm-cache} MOECOMM_TRANSPORT=${MOECOMM_TRANSPORT:-nvshmem}
T=$MOECOMM_TRANSPORT
MPIRUN=("$wrapper" -x PYTHONPATH -x PYTHONUNBUFFERED -x NVSHMEM_DISABLE_NVLS -x NCCL_NVLS_ENABLE
  -x NVSHMEM_REMOTE_TRANSPORT -x NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME -x MOECOMM_CACHE_DIR -x MOECOMM_TRANSPORT
  -x MOECOMM_IPC_HEAP_MB -x XLA_PYTHON_CLIENT_PREALLOCATE -x CUDA_VISIBLE_DEVICES)
status=0
step() { echo "=== $*"; timeout ${STEP_TIMEOUT:-240} "$@" 2>&1 | tee -a "$out/gpu_check.log"; local rc=${PIPESTATUS[0]}; echo "=== rc=$rc: $*"; [ "$rc" = 0 ] || status=1; }
# A run that breaks its communicator by design ends without MPI's finalization, which Open MPI's launcher
# reports as a failure: judge it by its printed result (the first argument, a grep pattern) instead.
# the GPU suite's runs that `python -m pytest tests/test_gpu.py -k EXPR` selects (PROGRAMS and its tests there)
suite() { STEP_TIMEOUT=${SUITE_TIMEOUT:-1800} step python3 -m pytest -q -rs tests/test_gpu.py -k "$1"; }
expect() { local want=$1; shift; echo "=== $*"; timeout ${STEP_TIMEOUT:-240} "$@" 2>&1 | tee -a "$out/gpu_check.log" | tee /tmp/step.txt;
  if grep -q -- "$want" /tmp/step.txt; then echo "=== ok ($want): $*"; else echo "=== FAILED (no '$want'): $*"; status=1; fi; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
  python3 -c "import cupy, cuda.bindings, cuda.core, mpi4py, numpy; import importlib.metadata as m; print({p: m.version(p) for p in ['cupy-cuda13x','cuda-bindings','cuda-core','nvidia-cuda-nvrtc','nvidia-nvjitlink','nvidia-nvshmem-cu13','nvshmem4py-cu13','mpi4py','numpy']})"; } 2>&1 | tee "$out/gpu_env.txt"
step python3 -m moecomm.build --arch sm_90 ${BUILD_VARIANTS:+--variants $BUILD_VARIANTS}
if [ "${1:-}" = jax ]; then  # moecomm.jax: correct first, then timed
  suite "mpi_jax or jitted_jax_steps"  # the programs at 1, 2 and 4 ranks; no Python per call in steady state
  export MOECOMM_TRANSPORT=ipc MOECOMM_IPC_HEAP_MB=${MOECOMM_IPC_HEAP_MB:-2048} XLA_PYTHON_CLIENT_PREALLOCATE=false
  step "${MPIRUN[@]}" -np 1 python3 tools/jax_step.py --json "$out/jax-step.json"
  exit $status
fi
if [ "${1:-}" = deep-ep ]; then  # DeepEP's low-latency API: our checks, then DeepEP's own test
  suite "mpi_deep_ep or deep_ep_pair"  # 1 rank on each transport, 2 (and 4) sharing GPU 0; the pair eager, replayed
  if [ -n "${DEEPEP_TESTS:-}" ]; then
    shim=$(mktemp -d); mkdir "$shim/deep_ep"
    printf '%s\n' "from moecomm.compat.deep_ep import *  # noqa: F401,F403" \
      "import deep_ep_shared_gpu  # noqa: F401,E402 (tests/: several ranks on one GPU)" > "$shim/deep_ep/__init__.py"
    for n in ${DEEPEP_RANKS:-1 2 4}; do
      ( export MOECOMM_TRANSPORT=ipc PYTHONPATH=$shim:$PWD/tests:$PYTHONPATH STEP_TIMEOUT=${STEP_TIMEOUT:-400}
        cd "$DEEPEP_TESTS"
        expect "Dispatch send/recv time" python3 test_low_latency.py --num-processes $n
        expect "Best combine" python3 test_intranode.py --num-processes $n; [ $status = 0 ] ) || status=1
    done
  fi
  exit $status
fi
if [ "${1:-}" = recovery ]; then  # never silent, always collective
  # 1 rank on each transport (control and its replays: the local path), 2, 4 and 8 ranks sharing GPU 0 (threads,
  # call ids eager and under lax.cond, quick sweeps)
  suite "mpi_recovery or mpi_control or mpi_threads or mpi_call_ids or (mpi_alltoall and quick and shared) or \
failed_calls_at_one_rank or replayed_out_of_order or exit_cases"
  export MOECOMM_TRANSPORT=ipc MOECOMM_IPC_HEAP_MB=${MOECOMM_IPC_HEAP_MB:-1024} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  STEP_TIMEOUT=$(( ${SOAK_MINUTES:-5} * 60 + 120 )) expect " 0 mismatches" "${MPIRUN[@]}" \
    --mca orte_abort_on_non_zero_status 0 -np 2 python3 tools/soak.py --minutes ${SOAK_MINUTES:-5} --transport ipc \
    --json "$out/soak-gpu.json"
  exit $status
fi
if [ "${1:-}" = ranks ]; then  # more ranks than GPUs: every rank on GPU 0, time-sliced, over ipc
  # world size 1 (the local path, cuda/local.cu: model sizes, refusals and failed calls) on both transports; 2, 4
  # and 8 ranks sharing GPU 0: sweeps, control, the JAX layer, telemetry, capacity, packed, replicas, masking, DP
  suite "alltoall_matches_reference or model_sized or failed_calls_at_one_rank or (shared and (mpi_alltoall or \
mpi_control or mpi_jax-2 or mpi_jax-4 or mpi_telemetry or mpi_capacity or mpi_packed or mpi_replicas or mpi_mask)) \
or program_fails_is_named"
  exit $status
fi
if [ "${1:-}" = grads ]; then  # gradients: the plan and both backward calls, then the layers, then timing
  # 1 rank on each transport and through puts only, 2 and 4 ranks sharing GPU 0
  suite "mpi_backward or mpi_jax_grad or mpi_torch_grad or backward_through_puts"
  [ -n "${GRAD_BENCH-1}" ] && step "${MPIRUN[@]}" -np 1 python3 tools/grad_bench.py --transport ipc \
    --iters ${BENCH_ITERS:-300} --json "$out/grad-ws1.json"
  [ -n "${GRAD_BENCH-1}" ] && [ "$ngpu" -gt 1 ] && step "${MPIRUN[@]}" -np "$ngpu" python3 tools/grad_bench.py \
    --transport $T --iters ${BENCH_ITERS:-300} --json "$out/ep$ngpu-gradients.json"
  if [ -n "${GRAD_NCU:-}" ]; then  # every kernel of one eager pass of each phase, forward and backward, at decode
    for cfg in r1-decode-cap32 r1-decode; do
      step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np 1 ncu --clock-control none -k "regex:moecomm_" --launch-count 12 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        python3 tools/grad_bench.py --transport ipc --configs $cfg --iters 1 --warmup 0 > "$out/ncu-grad-$cfg.txt"
    done
  fi
  exit $status
fi
if [ "${1:-}" = formats ]; then
  suite "mpi_formats"  # 1 rank on each transport, 2 and 4 sharing GPU 0
  bench=(python3 -m moecomm.bench --transport ipc --configs r1-decode --iters ${BENCH_ITERS:-300} --plot /dev/null)
  for round in 1 2; do  # ours and the baseline's in turn, twice: the GPU's state drifts between runs
    for w in bf16 e4m3 e4m3_ue8m0; do
      [ $round = 2 ] && [ $w != bf16 ] && continue
      wire=(); [ $w = bf16 ] || wire=(--combine-wire $w)
      step "${MPIRUN[@]}" -np 1 "${bench[@]}" "${wire[@]}" --json "$out/wire-$w-$round.json"
    done
    if [ -n "${BASELINE:-}" ]; then
      (cd "$BASELINE" && export PYTHONPATH=$PWD${PYTHONPATH#"$OLDPWD"} MOECOMM_CACHE_DIR=/tmp/moecomm-baseline &&
        step "${MPIRUN[@]}" -np 1 "${bench[@]}" --json "$out/baseline-bf16-$round.json")
    fi
  done
  exit $status
fi
if [ "${1:-}" = host ]; then  # the eager call path at world size 1 over ipc: correct first, then its host time
  suite "alltoall_matches_reference and ipc"
  step "${MPIRUN[@]}" -np 1 python3 tools/host_profile.py --transport ipc --parts
  step "${MPIRUN[@]}" -np 1 python3 tools/jax_host.py --transport ipc --parts --json "$out/ws1-jax-host.json"
  if [ -n "${BASELINE:-}" ]; then
    MOECOMM_TRANSPORT=ipc step python3 tools/host_ab.py --base "$BASELINE" --rounds ${ROUNDS:-2} --json "$out/ws1-host-ab.json"
  fi
  exit $status
fi
if [ "${1:-}" = ab ]; then  # interleaved: the GPU's state drifts between runs by more than most changes move
  [ -n "${BASELINE:-}" ] || { echo "gpu_check.sh ab: set BASELINE to a tree of the commit to compare with" >&2; exit 2; }
  bench=(python3 -m moecomm.bench --transport ipc --configs ${AB_CONFIGS:-r1-decode,v2-lite,sweep} --sweep-tokens 1,16
    --iters ${BENCH_ITERS:-300} --plot /dev/null)
  for round in $(seq "${ROUNDS:-2}"); do
    for base in $BASELINE; do  # several trees (a bisect): each in turn, each with its own kernel cache
      name=$(basename "$base"); [ "$(echo $BASELINE | wc -w)" = 1 ] && name=baseline
      (cd "$base" && export PYTHONPATH=$PWD${PYTHONPATH#"$OLDPWD"} MOECOMM_CACHE_DIR=/tmp/moecomm-$name &&
        step "${MPIRUN[@]}" -np 1 "${bench[@]}" --json "$out/$name-$round.json" && [ $status = 0 ]) || status=1
    done
    step "${MPIRUN[@]}" -np 1 "${bench[@]}" --json "$out/ab-$round.json"
  done
  exit $status
fi
suite "peer_check"
[ "${1:-}" = peer ] && exit $status
if [ "${1:-}" = faults ]; then
  suite "failed_calls or masked_dead_rank or stalls_is_named"  # (the last two need 2 GPUs)
  STEP_TIMEOUT=$(( ${SOAK_MINUTES:-2} * 60 + 120 )) step "${MPIRUN[@]}" -np "$ngpu" python3 tools/soak.py \
    --minutes ${SOAK_MINUTES:-2} --transport $T --json "$out/soak-gpu.json"
  exit $status
fi
if [ "${1:-}" = skew ]; then  # telemetry, capacity policies, expert maps in the kernels (tests)
  # both transports and through puts only (drop words, failure details), control, sweeps, embedding
  suite "operating_under_skew or failed_calls or alltoall_matches_reference or embedding"
  exit $status
fi
if [ "${1:-}" = skew-quick ]; then  # capacity, packed layout on both transports, the telemetry example, --ep-size 1
  suite "(operating_under_skew and (capacity or packed) and not puts) or routing_telemetry_example"
  expect "^zipf " "${MPIRUN[@]}" -np "$ngpu" python3 -m moecomm.loadtest --transport ipc --ep-size 1 --scenarios zipf \
    --experts 64 --topk 4 --hidden 1024 --tokens 32 --steps 20 --json "$out/loadtest-ep1.json" --plot "$out/loadtest-ep1.png"
  # 4 ranks time-sliced over ipc: EP x TP (a host all-reduce where ranks share a GPU) and the expert owners
  # stopped in turn
  expect "outputs equal, all-reduce right" "${MPIRUN[@]}" -np 4 python3 -m moecomm.loadtest --transport ipc \
    --scenarios zipf,tp --experts 64 --topk 4 --hidden 1024 --tokens 32 --steps 10 --json "$out/loadtest-tp.json" \
    --plot "$out/loadtest-tp.png"
  expect "rank 3 stopped: 0 pairs lost, outputs equal" "${MPIRUN[@]}" -np 4 python3 -m moecomm.loadtest \
    --transport ipc --scenarios owners --experts 64 --topk 4 --hidden 1024 --tokens 32 --steps 8 \
    --json "$out/loadtest-owners.json" --plot "$out/loadtest-owners.png"
  exit $status
fi
if [ "${1:-}" = skew-bench ]; then  # the cost of telemetry and timing; the load tool
  nccl=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0] + '/lib')" 2>/dev/null)
  export LD_LIBRARY_PATH=${nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  for v in "--telemetry-window 0" "--telemetry-window 64" "--timing" "--layout packed" "--tags 16 --score-gap"; do
    # telemetry off / on / timing; packed; tags and router confidence counted
    f=$(echo "$v" | tr -d ' -'); STEP_TIMEOUT=${BENCH_TIMEOUT:-200} step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" \
      python3 -m moecomm.bench --transport $T --configs r1-decode,r1-prefill --iters ${BENCH_ITERS:-500} $v --json "$out/bench-$f.json"
  done
  step python3 -m moecomm.bench --merge "$out"/bench-telemetrywindow0.json "$out"/bench-telemetrywindow64.json \
    "$out"/bench-timing.json "$out"/bench-layoutpacked.json "$out"/bench-tags16scoregap.json --json "$out/bench-telemetry.json" \
    --plot "$out/bench-telemetry.png"
  expect "CommTimeout naming rank" "${MPIRUN[@]}" -np "$ngpu" python3 -m moecomm.loadtest --transport $T \
    --scenarios zipf,moving-hot,capacity,mask --experts 256 --topk 8 --hidden 7168 --tokens 128 --steps ${LOAD_STEPS:-200} \
    --spare-slots 16 --replan 20 --timeout 2 --json "$out/loadtest-ep$ngpu.json" --plot "$out/loadtest-ep$ngpu.png"
  exit $status
fi
# CuPy's NCCL binding finds libnccl through the loader path (the nvidia-nccl wheel)
nccl=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0] + '/lib')" 2>/dev/null)
export LD_LIBRARY_PATH=${nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ "${1:-}" = latency ]; then
  # sweeps on both transports and through puts only, world size 1, the model-sized and streamed cases, capacity,
  # packed, replicas, telemetry, a skipped (streamed) phase, masking, control, torch tensors, embedding
  suite "alltoall_matches_reference or network_path or model_sized or (operating_under_skew and not puts) or \
skipped_rank or masked_dead_rank or failed_calls or torch_tensors or embedding"
  for t in ipc nvshmem; do
    for tok in 1 128; do
      MOECOMM_TRACE=1 step "${MPIRUN[@]}" -x MOECOMM_TRACE -np "$ngpu" python3 tools/trace_kernels.py --transport $t \
        --tokens $tok --json "$out/trace-$t-$tok.json"
    done
  done
  exit $status
fi
if [ "${1:-}" = transports ] || [ "${1:-}" = bench-both ]; then
  export MOECOMM_TRANSPORT=ipc
  [ "$1" = bench-both ] || {
    suite "peer_check or alltoall_matches_reference or failed_calls or masked_dead_rank or skipped_rank or \
embedding or torch_example or jax_example or demo"
  }
  for t in nvshmem ipc; do
    STEP_TIMEOUT=${BENCH_TIMEOUT:-200} step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" python3 -m moecomm.bench \
      --transport $t --configs ${BENCH_CONFIGS:-r1-decode,r1-prefill,sweep} --sweep-tokens ${SWEEP_TOKENS:-1,16,128,1024,4096} \
      --iters ${BENCH_ITERS:-300} --json "$out/bench-$t.json" --plot "$out/bench-$t.png"
  done
  step python3 -m moecomm.bench --merge "$out/bench-nvshmem.json" "$out/bench-ipc.json" --json "$out/bench-both.json" \
    --plot "$out/bench-both.png"
  exit $status
fi
if [ "${1:-}" = floors ]; then  # what the phases could reach at best: HBM rates of their patterns, bare exchanges
  step python3 tools/hbm_floor.py --world 2,1 --json "$out/hbm-floor.json"
  for t in ipc nvshmem; do
    step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np 2 python3 tools/exchange_floor.py --transport $t --json "$out/exchange-floor-$t.json"
  done
  exit $status
fi
if [ "${1:-}" = profile ]; then
  STEP_TIMEOUT=${BENCH_TIMEOUT:-300} step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" python3 -m moecomm.bench \
    --configs ${BENCH_CONFIGS:-r1-decode,r1-prefill,sweep} --sweep-tokens ${SWEEP_TOKENS:-1,16,512} \
    --iters ${BENCH_ITERS:-500} --json "$out/bench.json" --plot "$out/bench.png"
  step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" python3 -m moecomm.bench --configs r1-decode --delay-us 0 \
    --iters 300 --json "$out/bench-nodelay.json"  # host launch latency left in, as in earlier runs
  ncu=(ncu --clock-control none -k "regex:moecomm_(dispatch|combine)")
  one=(python3 -m moecomm.bench --configs sweep --iters 1 --warmup 0 --no-graph --json /tmp/ncu.json --plot /tmp/ncu.png)
  for tok in 1 128 4096; do  # world size 1: every kernel's counters (replay is safe: no peer involved)
    step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np 1 "${ncu[@]}" --launch-skip 4 --launch-count 4 --section SpeedOfLight --section LaunchStats \
      --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      "${one[@]}" --sweep-tokens $tok > "$out/ncu-ws1-$tok.txt"
  done
  for tok in 1 128 4096; do  # every rank: durations only (one pass, no replay across peers)
    step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" "${ncu[@]}" --launch-skip 4 --launch-count 4 \
      --metrics gpu__time_duration.sum "${one[@]}" --sweep-tokens $tok > "$out/ncu-ws$ngpu-$tok.txt"
  done
  suite "alltoall_matches_reference"
  exit $status
fi
# the sweeps; embedding: torch tensors and raw buffers through the sweep, devices and streams, the examples,
# torchrun; a silent rank; the demo; the put path (quick and bench), the model-sized and streamed cases (bench)
suite "alltoall_matches_reference or torch_tensors or raw_device_buffers or embedding or torch_example or \
jax_example or mpi_jax-1 or torch_distributed or skipped_rank or demo or network_path$([ "${1:-}" = bench ] &&
  echo " or model_sized")"
if [ "${1:-}" = quick ]; then
  STEP_TIMEOUT=${BENCH_TIMEOUT:-300} step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" python3 -m moecomm.bench --transport $T \
    --configs ${BENCH_CONFIGS:-r1-decode} --iters ${BENCH_ITERS:-300} --json "$out/bench-$T.json" --plot "$out/bench-$T.png"
  exit $status
fi
[ "${1:-}" = bench ] || { [ $status = 0 ] && suite "model_sized"; }
if [ "${1:-}" = bench ] && [ $status = 0 ]; then
  step "${MPIRUN[@]}" -np "$ngpu" python3 tools/host_profile.py --transport $T  # where an eager call's host time goes

  STEP_TIMEOUT=${BENCH_TIMEOUT:-300} step "${MPIRUN[@]}" -x LD_LIBRARY_PATH -np "$ngpu" python3 -m moecomm.bench \
    --transport $T --configs ${BENCH_CONFIGS:-r1-decode,r1-prefill,v2-lite,sweep} ${SWEEP_TOKENS:+--sweep-tokens $SWEEP_TOKENS} \
    --iters ${BENCH_ITERS:-1000} --json "$out/bench-$T.json" --plot "$out/bench-$T.png"
fi
exit $status
