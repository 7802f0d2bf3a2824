#!/usr/bin/env bash
# One measurement call on the H200 device host (see docs/benchmarks.md).
# Usage (repository root, after the warp parts were installed into /tmp/site):
#   bash benchmarks/h200_session.sh PHASE OUTDIR
# PHASE: lj (GPU tests, NCCL suite at 1 rank, LJ vs the peer, largest LJ),
#        models (MPNN, MACE, PME, ensembles, compile), graphs (CUDA-graph tests and
#        LJ 131k / 1M with steady steps replayed and eager), halograph (the halo
#        path's split capture: GPU graph tests, LJ with the halo forced, graphs on
#        and off), h1prof / h1kernels (where a halo step goes on one GPU), x2final
#        (two GPUs: the split capture with NCCL, LJ and MPNN scaling, GP, MACE),
#        h1compile (the compiled MPNN against eager on one GPU), h1mpnntest, h1mpnn, h1mpnnhalo
#        (the MPNN's captured steps: GPU tests; compiled vs eager on both
#        neighbour paths, whole batch and halo forced), h1trace (what
#        each rebuild costs a captured run, step by step), h1rebuild (the same
#        trace, profiler ranges of forced rebuilds, every GPU test and the NCCL
#        suite with the halo forced), h1cueq (MACE with cuEquivariance, until OOM),
#        h1ens (the ensembles' integrators on one GPU: NVE, NVT-NH, NPT),
#        h1graphtests (the CUDA-graph integration tests on one GPU), h1pool
#        (A/B of the capture's memory pools: rebuild cycles, halo forced),
#        h1cells (the device list's cells per search radius: builds and LJ steps),
#        h1rows (the list build's thread order: builds, LJ steps, models GPU tests),
#        h1rebuildab (forced rebuild steps, this tree against .ab_base, alternated),
#        h1traceab (a run's steps one by one, halo forced, this tree against .ab_base),
#        h1timeline (host, device and waits of forced rebuild steps, halo forced),
#        h1after (the same for rebuild steps and for the capture step after each),
#        h1checks (GPU tests of every package and of the captured steps; the NCCL
#        suite at 1 rank with the halo forced, fp64 and fp32),
#        h1waitab (the list build waited for or not under DD, legs alternated, with
#        the capture step's host time in parts),
#        h1maceab (MACE with the halo forced, product blocks on all rows or owned
#        rows only, legs alternated),
#        h1fireab (FIRE on the host against FIRE on the device, captured and eager),
#        h1ljab (the LJ step of .ab_base against this tree, alternated),
#        h1virials (the cost of LJConfig(atom_virials=True), legs alternated),
#        h1npttests / h1nptab (NPT on the device: GPU tests; the integrators' step
#        times against the commit before, NPT on the host, in one call),
#        or a benchmark name.
set -uo pipefail
phase="${1:-lj}"
out="${2:-/tmp/nvdd-h200}"
mkdir -p "$out"
if [ -d .whl ] && [ ! -f /tmp/site/.nvdd-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.nvdd-wheels
fi
export PYTHONPATH="/tmp/site:$(ls -d "$PWD"/packages/*/src | tr '\n' ':')"
export PYTHONUNBUFFERED=1 WARP_CACHE_PATH=/tmp/warp-cache
step() { echo; echo "=== $* ($(date +%T))"; }
quiet() { grep -v -i "^warp \|^module \|kernel cache\|cuda toolkit\|devices:\|\"cuda:0\"\|\"cpu\"\|/tmp/warp-cache"; }
# ab_legs WHAT PROFILE_ARGS GREP: LJ fp32 at 1M and 256k atoms, halo forced on one
# GPU, profile_dd.py with PROFILE_ARGS, legs alternated base / this tree twice;
# base: AB_BASE, a source copy of the base commit's packages (untracked, carried)
ab_legs() {
  local base_path pp
  base_path="/tmp/site:$(ls -d "$PWD/${AB_BASE:-.ab_base}"/packages/*/src | tr '\n' ':')"
  for cells in 63 40; do
    for leg in base new base new; do
      step "LJ fp32 cells=$cells, halo forced on one GPU, $1: $leg"
      if [ "$leg" = base ]; then pp="$base_path"; else pp="$PYTHONPATH"; fi
      # shellcheck disable=SC2086
      PYTHONPATH="$pp" timeout 200 python3 benchmarks/profile_dd.py --device cuda --world 1 --halo \
        --cells $cells --dtype float32 $2 2>&1 | quiet | grep -A1 "$3"
    done
  done
}
# tree_legs TITLE SIZES LEG: for each size, LEG SIZE base|new with the packages of
# AB_BASE (a source copy of the base commit, carried) and of this tree, alternated
tree_legs() {
  local base_path size leg
  base_path="/tmp/site:$(ls -d "$PWD/${AB_BASE:-.ab_base}"/packages/*/src | tr '\n' ':')"
  for size in $2; do
    for leg in base new base new; do
      step "$1, cells=$size: $leg"
      if [ "$leg" = base ]; then PYTHONPATH="$base_path" "$3" "$size" "$leg"
      else "$3" "$size" "$leg"; fi
    done
  done
}
case "$phase" in
lj)
  step "device"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, warp, vesin, nvalchemiops; print('torch', torch.__version__, 'warp', warp.__version__)" 2>&1 | quiet
  step "GPU tests (-m gpu --require-gpu)"
  timeout 240 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    -x packages/nvdd-models/tests packages/nvdd-halo/tests packages/nvdd-dynamics/tests 2>&1 | tail -6
  step "NCCL integration suite, 1 rank, fp64 + fp32"
  timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    integration_tests/multigpu_suite.py --allow-single --dtype both 2>&1 | grep -E "PASS|FAIL|scenarios|Error|error"
  step "LJ: nvdd vs the nvalchemi-toolkit-ops peer loop (same system, same run)"
  timeout 400 python3 benchmarks/bench_dp.py --device cuda --cells 32 63 100 --dtype float32 float64 \
    --steps 100 --warmup 20 --worlds 1 --json "$out/peer.json" 2>&1 | quiet
  ;;
largest)
  step "largest LJ fp32 on one GPU"
  timeout 500 python3 benchmarks/bench_dp.py --device cuda --largest --dtype float32 --start-cells 150 \
    --json "$out/largest.json" 2>&1 | quiet
  ;;
mpnn)
  step "reference MPNN, 97,556 and 389,344 atoms, fp32: raw and DomainParallel at 1 GPU"
  timeout 400 python3 benchmarks/bench_dp.py --device cuda --model mpnn --cells 29 46 --dtype float32 \
    --steps 30 --warmup 5 --worlds 1 --json "$out/mpnn.json" 2>&1 | quiet
  ;;
tests)
  step "GPU tests (-m gpu --require-gpu), every package"
  timeout 300 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short packages/nvdd-models/tests packages/nvdd-halo/tests packages/nvdd-dynamics/tests \
    packages/nvdd-padding/tests packages/nvdd-shardtensor/tests packages/nvdd-partition/tests \
    > "$out/gpu_tests.log" 2>&1; tail -15 "$out/gpu_tests.log"
  step "NCCL integration suite, 1 rank, fp64 + fp32 (with MACE)"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    integration_tests/multigpu_suite.py --allow-single --dtype both 2>&1 | grep -E "PASS|FAIL|scenarios|Error|error"
  ;;
mace)
  shift 2
  step "MACE medium: plain vs DomainParallel on 1 GPU $*"
  timeout 540 python3 benchmarks/bench_mace.py --device cuda --modes plain dd1 --start-cells 24 \
    --doublings 6 --steps 5 --warmup 2 "$@" 2>&1 | quiet
  ;;
models2)
  step "MACE medium fp32: plain vs DomainParallel on 1 GPU, doubling until OOM"
  timeout 400 python3 benchmarks/bench_mace.py --device cuda --modes plain dd1 --start-cells 24 \
    --doublings 5 --steps 5 --warmup 2 --dtypes float32 --json "$out/mace32.json" 2>&1 | quiet
  step "compiled vs eager DD, reference MPNN 97,556 atoms fp32"
  timeout 150 python3 benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 \
    --dtype float32 --steps 100 --warmup 20 --worlds 1 2>&1 | quiet
  ;;
models3)
  step "MACE medium fp64: plain vs DomainParallel on 1 GPU"
  timeout 200 python3 benchmarks/bench_mace.py --device cuda --modes plain dd1 --start-cells 24 \
    --doublings 3 --steps 5 --warmup 2 --dtypes float64 --json "$out/mace64.json" 2>&1 | quiet
  step "PME 100k charges: raw and DD on 1 GPU"
  timeout 90 python3 benchmarks/bench_pme.py --device cuda --atoms 100000 --worlds 1 2>&1 | quiet
  step "LJ GPU tests (the no-host-sync guard on CUDA)"
  timeout 120 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short packages/nvdd-models/tests/test_models_lj_warp.py packages/nvdd-models/tests/test_models_mace.py 2>&1 | tail -8
  ;;
models4)
  step "compiled vs eager DD (halo forced on one GPU), reference MPNN 97,556 atoms fp32"
  timeout 200 python3 benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 \
    --dtype float32 --steps 100 --warmup 20 --worlds 1 --halo 2>&1 | quiet
  step "MACE medium fp32 and fp64 at 4,096 and 8,192 atoms"
  timeout 300 python3 benchmarks/bench_mace.py --device cuda --modes plain dd1 --start-cells 16 \
    --doublings 1 --steps 5 --warmup 2 --dtypes float64 float32 --json "$out/mace_small.json" 2>&1 | quiet
  ;;
graphs)
  step "CUDA-graph tests: replayed steps equal eager steps on the GPU"
  timeout 240 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short integration_tests/test_it_cuda_graphs.py packages/nvdd-models/tests/test_models_lj_warp.py \
    2>&1 | tail -12
  step "LJ 131k and 1M: peer, raw and DomainParallel at 1 GPU, steady steps replayed and eager"
  timeout 520 python3 benchmarks/bench_dp.py --device cuda --cells 32 63 --dtype float32 float64 \
    --graphs on off --steps 200 --warmup 30 --worlds 1 --json "$out/graphs.json" 2>&1 | quiet
  ;;
x2suite)
  step "device topology"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -4
  step "NCCL integration suite on 2 GPUs, fp64 + fp32 (tools/multigpu: no installs)"
  NVDD_PYTHON=python3 timeout 300 tools/multigpu --dtype both 2>&1 | grep -E "PASS|FAIL|scenarios|Error|error|Traceback" | head -40
  step "nvdd run --device cuda --nproc 2 (256,000 atoms)"
  timeout 200 python3 -m nvalchemi.distributed.cli run --device cuda --nproc 2 --cells 40 \
    --nvt-steps 50 --nve-steps 50 --out "$out/run2" 2>&1 | grep -v -i "it/s\|warp \|module " | tail -25
  ;;
x2lj)
  step "LJ 1M and 4M, fp32 + fp64: peer, raw, DomainParallel on 1 and 2 GPUs"
  timeout 570 python3 benchmarks/bench_dp.py --device cuda --cells 63 100 --dtype float32 float64 \
    --steps 50 --warmup 10 --worlds 1 2 --json "$out/x2_lj.json" 2>&1 | quiet
  ;;
x2mpnn)
  step "reference MPNN 97,556 and 389,344 atoms fp32: raw, DomainParallel on 1 and 2 GPUs"
  timeout 330 python3 benchmarks/bench_dp.py --device cuda --model mpnn --cells 29 46 --dtype float32 \
    --steps 20 --warmup 5 --worlds 1 2 --json "$out/x2_mpnn.json" 2>&1 | quiet
  step "weak scaling: 2,048,000 LJ atoms fp32 on 2 GPUs (1M per GPU; 1 GPU at 1M in x2lj)"
  timeout 200 python3 benchmarks/bench_dp.py --device cuda --cells 80 --dtype float32 --no-peer \
    --steps 50 --warmup 10 --worlds 2 --json "$out/x2_weak.json" 2>&1 | quiet
  ;;
x2final)
  # (ordered by priority: a short lease may end the call early)
  step "the split capture on two GPUs (NCCL collectives inside the graphs): replayed vs eager"
  timeout 120 python3 -m pytest -p nvdd.testing.plugin -q -m multigpu -p no:cacheprovider --tb=short \
    integration_tests/test_it_cuda_graphs.py 2>&1 | tail -4
  step "LJ 1M fp32: peer, raw, DomainParallel on 1 and 2 GPUs (domain and pbc kept on the GPU)"
  timeout 120 python3 benchmarks/bench_dp.py --device cuda --cells 63 --dtype float32 \
    --steps 100 --warmup 20 --worlds 1 2 --json "$out/x2_lj_final.json" 2>&1 | quiet
  step "LJ 1M fp32 on 2 GPUs: 200 steps timed one by one (rebuild / capture / replay), kept graph pools"
  timeout 120 python3 benchmarks/profile_dd.py --device cuda --world 2 --cells 63 --dtype float32 \
    --warmup 30 --steps 5 --trace 200 2>&1 | quiet | grep -A2 "trace ("
  step "reference MPNN 389,344 atoms fp32: raw, DomainParallel on 1 and 2 GPUs"
  timeout 100 python3 benchmarks/bench_dp.py --device cuda --model mpnn --cells 46 --dtype float32 \
    --steps 20 --warmup 5 --worlds 1 2 --json "$out/x2_mpnn_final.json" 2>&1 | quiet
  step "MPNN 97,556 atoms fp32: HALO vs GRAPH_PARTITION on 1 and 2 GPUs"
  timeout 100 python3 benchmarks/bench_graph_partition.py --part step --device cuda --cells 29 \
    --worlds 1 2 --steps 20 2>&1 | quiet
  step "where a 2-GPU LJ step goes (1M atoms fp32): steady steps vs rebuild steps"
  timeout 60 python3 benchmarks/profile_dd.py --device cuda --world 2 --cells 63 --dtype float32 \
    --steps 40 2>&1 | quiet | grep -v "USDT" | head -8
  step "MACE medium fp64: plain (1 GPU) and DomainParallel on 2 GPUs, 4,096 and 8,192 atoms"
  timeout 150 python3 benchmarks/bench_mace.py --device cuda --modes plain dd2 --start-cells 16 \
    --doublings 1 --steps 3 --warmup 1 --dtypes float64 --json "$out/x2_mace64.json" 2>&1 | quiet \
    | grep -v "UserWarning\|_Jd, _W3j\|cuequivariance or"
  ;;
h1prof)
  step "the halo path on one GPU, 1M atoms fp32: per-step times as bench_dp sees them, host profile"
  timeout 300 python3 benchmarks/profile_dd.py --device cuda --world 1 --halo --cells 63 --dtype float32 \
    --warmup 10 --steps 50 --breakdown 3 2>&1 | quiet | grep -v "USDT" | sed -n '1,3p;/---/,$p'
  step "bench_dp halo forced, 1M fp32 (rebuilds in the timed window)"
  timeout 200 python3 benchmarks/bench_dp.py --device cuda --cells 63 --dtype float32 --no-peer \
    --steps 50 --warmup 10 --worlds 1 --json "$out/h1_halo.json" 2>&1 | quiet
  python3 -c "import json; [print(r.get('run'), r.get('label', ''), r.get('ms_per_step'), 'rebuilds', r.get('rebuilds')) for r in json.load(open('$out/h1_halo.json'))]" 2>&1 | tail -5
  ;;
halograph)
  step "GPU tests: captured steps (CUDA graphs), the halo path's split capture included"
  timeout 240 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short integration_tests/test_it_cuda_graphs.py 2>&1 | tail -6
  step "LJ 131k / 1M fp32 + fp64: peer, raw, DomainParallel whole and halo forced, graphs on and off"
  timeout 330 python3 benchmarks/bench_dp.py --device cuda --cells 32 63 --dtype float32 float64 \
    --steps 100 --warmup 20 --worlds 1 --graphs on off --json "$out/h1_halograph.json" 2>&1 | quiet
  ;;
h1kernels)
  for mode in "" "--halo"; do
    step "GPU time per kernel, 10 steady steps of LJ 1M fp32 on one GPU ${mode:-(whole batch)} (graphs on)"
    timeout 150 python3 benchmarks/profile_dd.py --device cuda --world 1 $mode --cells 63 --dtype float32 \
      --warmup 30 --steps 20 --steady-window 2>&1 | quiet | grep -v "USDT" | sed -n '2,3p;/Self CUDA time total/,$p' | head -34
  done
  step "MPNN 97,556 atoms fp32: HALO vs GRAPH_PARTITION on one GPU"
  timeout 150 python3 benchmarks/bench_graph_partition.py --part step --device cuda --cells 29 \
    --worlds 1 --steps 20 2>&1 | quiet
  ;;
h1compile)
  for extra in "" "" "--halo"; do
    step "MPNN 97,556 atoms fp32: compiled vs eager DomainParallel on one GPU ${extra:-(whole batch)}"
    timeout 240 python3 benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 --dtype float32 \
      --steps 100 --warmup 60 --worlds 1 --chunks 4 $extra 2>&1 | quiet | tail -4
  done
  ;;
h1mpnntest)
  step "GPU tests: the MPNN's captured steps (eager and compiled) and the earlier capture tests"
  timeout 500 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    integration_tests/test_it_mpnn_graphs.py integration_tests/test_it_cuda_graphs.py 2>&1 | tail -15
  ;;
h1mpnn)
  for nb in device device verlet; do
    step "MPNN 97,556 atoms fp32: compiled vs eager DomainParallel on one GPU, neighbors=$nb"
    timeout 240 python3 benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 --dtype float32 \
      --steps 100 --warmup 60 --worlds 1 --chunks 4 --neighbors $nb 2>&1 | quiet | tail -3
  done
  ;;
h1mpnnhalo)
  # dt 4 fs: a halo rebuild every ~3 steps; dt 1 fs: rare rebuilds
  for dt in ${MPNN_HALO_DTS:-4}; do
    for nb in device verlet; do
      step "MPNN 97,556 atoms fp32, halo forced on one GPU, dt $dt fs: compiled vs eager, neighbors=$nb"
      timeout 280 python3 benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 --dtype float32 \
        --steps 100 --warmup 60 --worlds 1 --chunks 4 --halo --dt $dt --neighbors $nb 2>&1 | quiet | tail -3
    done
  done
  ;;
h1trace)
  for mode in "--halo" ""; do
    step "LJ 1M fp32 on one GPU ${mode:-(whole batch)}: 200 steps timed one by one (graphs on)"
    timeout 200 python3 benchmarks/profile_dd.py --device cuda --world 1 $mode --cells 63 --dtype float32 \
      --warmup 30 --steps 5 --trace 200 2>&1 | quiet | grep -A1 "trace ("
  done
  step "MPNN 97,556 atoms fp32: compiled with mode=reduce-overhead vs eager, whole batch"
  timeout 240 python3 benchmarks/bench_compile.py --device cuda --model mpnn --cells 29 --dtype float32 \
    --steps 100 --warmup 60 --worlds 1 --chunks 4 --compile-mode reduce-overhead 2>&1 | quiet | tail -3
  ;;
h1rebuild)
  step "LJ 1M fp32, halo forced on one GPU: 200 steps timed one by one (graphs on)"
  timeout 200 python3 benchmarks/profile_dd.py --device cuda --world 1 --halo --cells 63 --dtype float32 \
    --warmup 30 --steps 5 --trace 200 2>&1 | quiet | grep -A1 "trace ("
  step "the same, 3 forced rebuilds as profiler ranges (host ms, device ms)"
  timeout 150 python3 benchmarks/profile_dd.py --device cuda --world 1 --halo --cells 63 --dtype float32 \
    --warmup 10 --steps 10 --ranges 3 2>&1 | quiet | sed -n '/forced rebuild steps, ranges/,$p' | head -26
  step "GPU tests, every package; then the NCCL suite at 1 rank with the halo path forced"
  timeout 300 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short packages/nvdd-models/tests packages/nvdd-halo/tests packages/nvdd-dynamics/tests \
    packages/nvdd-padding/tests packages/nvdd-shardtensor/tests packages/nvdd-partition/tests \
    > "$out/gpu_tests.log" 2>&1; tail -6 "$out/gpu_tests.log"
  timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    integration_tests/multigpu_suite.py --allow-single --halo --dtype both 2>&1 | grep -E "PASS|FAIL|scenarios|Error|error"
  ;;
h1cueq)
  step "MACE medium with cuEquivariance, fp32 then fp64: plain vs DomainParallel on one GPU, doubling until OOM"
  for dt in ${CUEQ_DTYPES:-float32}; do
    timeout ${CUEQ_TIMEOUT:-280} python3 benchmarks/bench_mace.py --device cuda --modes plain dd1 --dtypes $dt --cueq on \
      --start-cells 24 --doublings ${CUEQ_DOUBLINGS:-3} --steps 5 --warmup 2 --json "$out/cueq_$dt.json" 2>&1 | quiet \
      | grep -v "UserWarning\|warn\|_Jd, _W3j\|torch.tensor(atomic\|^ \|^~\|^$\|Call using\|reshape\|cat = \|Traceback\|OutOfMemoryError: CUDA"
  done
  ;;
h1pool)
  step "A/B: captures into kept GraphPools (new) vs torch.cuda.graph (old), halo forced, one GPU"
  for c in ${POOL_CELLS:-63 32}; do
    for leg in new old new old; do
      flag=""; [ "$leg" = old ] && flag="--torch-capture"
      echo "--- cells $c fp32, $leg capture"
      timeout 200 python3 benchmarks/profile_dd.py --device cuda --world 1 --halo --cells $c --dtype float32 \
        --warmup 30 --steps 5 --trace 200 $flag 2>&1 | quiet | grep -A2 "trace ("
    done
  done
  ;;
h1cells)
  step "Device list build by cells per search radius, against the peer's cell list (half lists, 9.5 A)"
  timeout 200 python3 benchmarks/bench_neighbors.py --device cuda --cells 32 63 100 --dtype float32 float64 \
    --json "$out/neighbors.json" 2>&1 | quiet
  for c in ${CELLS_SIZES:-63 100}; do
    for k in 1 2; do
      step "LJ fp32, cells $c, device list with $k cell(s) per search radius (bench_dp, one GPU, peer in the same run)"
      NVDD_BENCH_CELLS_PER_CUTOFF=$k timeout 200 python3 benchmarks/bench_dp.py --device cuda --cells $c \
        --dtype float32 --steps 100 --warmup 20 --worlds 1 --json "$out/dp_c${k}_$c.json" 2>&1 | quiet
    done
  done
  ;;
h1rows)
  step "Device list build: threads in cell order vs row order (half lists, 9.5 A), the peer's cell list"
  timeout 150 python3 benchmarks/bench_neighbors.py --device cuda --cells 32 63 100 --dtype float32 float64 \
    --per-cutoff 1 --json "$out/neighbors_rows.json" 2>&1 | quiet
  for c in ${ROWS_SIZES:-63 100}; do
    for r in 0 1; do
      step "LJ fp32, cells $c, build in row order: $r (bench_dp, one GPU, peer in the same run)"
      NVDD_BENCH_ROW_ORDER=$r timeout 150 python3 benchmarks/bench_dp.py --device cuda --cells $c \
        --dtype float32 --steps 100 --warmup 20 --worlds 1 --json "$out/dp_rows${r}_$c.json" 2>&1 | quiet \
        | grep -E "^run|^peer|^raw|^Domain|build"
    done
  done
  step "models GPU tests with every device list built in row order"
  timeout 150 python3 -c "import sys, pytest, nvdd.models._device_neighbors as m
m.DeviceVerletList.row_order_build = True
sys.exit(pytest.main(['-p', 'nvdd.testing.plugin', '-q', '-m', 'gpu', '--require-gpu', '-p', 'no:cacheprovider', 'packages/nvdd-models/tests']))" 2>&1 | tail -3
  ;;
h1graphtests)
  step "CUDA-graph integration tests on one GPU (-m gpu): replays vs eager, NVE / Langevin / NVT-NH"
  timeout 300 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short integration_tests/test_it_cuda_graphs.py 2>&1 | tail -8
  ;;
h1ens)
  step "Integrators on one GPU, fp64 LJ argon: velocity Verlet (captured), NVT-NH, NPT iso/full"
  for c in ${ENS_CELLS:-10 32 63}; do
    timeout 200 python3 benchmarks/bench_ensembles.py timing --device cuda --cells $c --steps ${ENS_STEPS:-200} \
      --json "$out/ens_$c.json" 2>&1 | quiet | grep -v Warning
  done
  ;;
h1npttests)
  step "GPU tests of nvdd-core and nvdd-dynamics; the CUDA-graph integration tests (NVE, Langevin, NVT-NH, NPT)"
  timeout 200 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short packages/nvdd-core/tests packages/nvdd-dynamics/tests 2>&1 | tail -4
  timeout 300 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short integration_tests/test_it_cuda_graphs.py 2>&1 | tail -6
  ;;
h1nptab)
  step "Integrators on one GPU, this commit and (same call) the commit before it (NPT on the host): ${NPT_AB_BASE:=HEAD~1}"
  git worktree add -f /tmp/nvdd-base "$NPT_AB_BASE" >/dev/null 2>&1 || true
  base_path="/tmp/site:$(ls -d /tmp/nvdd-base/packages/*/src | tr '\n' ':')"
  for c in ${ENS_CELLS:-10 32 63}; do
    echo "--- cells $c: this commit"
    timeout 150 python3 benchmarks/bench_ensembles.py timing --device cuda --cells $c --steps ${ENS_STEPS:-200} \
      --json "$out/ens_$c.json" 2>&1 | quiet | grep -v Warning
    echo "--- cells $c: base (host NPT)"
    (cd /tmp/nvdd-base && PYTHONPATH="$base_path" timeout 150 python3 benchmarks/bench_ensembles.py timing --device cuda \
      --cells $c --steps ${ENS_STEPS:-200} --json "$out/ens_base_$c.json" 2>&1 | quiet | grep -v Warning | grep npt)
  done
  ;;
h1rebuildab)
  ab_legs "20 forced rebuilds timed alone" "--warmup 20 --steps 20 --forced 20" "steady step"
  step "LJ fp32 cells=63, halo forced: timeline of a forced rebuild step (this commit)"
  timeout 200 python3 benchmarks/timeline_dd.py --device cuda --cells 63 --dtype float32 \
    --steps 2 --warmup 20 --top 30 2>&1 | quiet | sed -n '1,/^host calls/p'
  ;;
h1traceab)
  ab_legs "200 steps timed one by one (graphs on)" "--warmup 30 --steps 5 --trace 200" "trace ("
  ;;
h1timeline)
  for cells in 63 40; do
    step "LJ fp32 cells=$cells, halo forced on one GPU: timeline of forced rebuild steps"
    timeout 240 python3 benchmarks/timeline_dd.py --device cuda --cells $cells --dtype float32 \
      --steps 2 --warmup 20 --top 45 --chrome "$out/timeline_$cells.json" 2>&1 | quiet
    gzip -f "$out/timeline_$cells.json"
  done
  ;;
h1checks)
  step "GPU tests: every package, the CUDA-graph integration tests; the NCCL suite at 1 rank, halo forced"
  timeout 300 python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
    --tb=short packages/nvdd-models/tests packages/nvdd-halo/tests packages/nvdd-dynamics/tests \
    packages/nvdd-padding/tests packages/nvdd-shardtensor/tests packages/nvdd-partition/tests \
    packages/nvdd-core/tests integration_tests/test_it_cuda_graphs.py \
    > "$out/gpu_tests.log" 2>&1; tail -8 "$out/gpu_tests.log"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
    integration_tests/multigpu_suite.py --allow-single --halo --dtype both 2>&1 | grep -E "PASS|FAIL|scenarios|Error|error"
  ;;
h1after)
  for cells in 40 63; do
    for mode in "" "--after"; do
      step "LJ fp32 cells=$cells, halo forced on one GPU: timeline ${mode:-of forced rebuild steps}"
      timeout 240 python3 benchmarks/timeline_dd.py --device cuda --cells $cells --dtype float32 \
        --steps 2 --warmup 20 --top 40 $mode 2>&1 | quiet
    done
  done
  ;;
h1waitab)
  # the list build waited for (NVDD_BENCH_WAIT_BUILDS=1) or not (the LJ default
  # under DD), this tree, legs alternated; the capture step's host time in parts
  for cells in 63 40; do
    for leg in nowait wait nowait wait; do
      step "LJ fp32 cells=$cells, halo forced on one GPU, 200 steps one by one: $leg"
      if [ "$leg" = wait ]; then w=1; else w=0; fi
      NVDD_BENCH_WAIT_BUILDS=$w timeout 200 python3 benchmarks/profile_dd.py --device cuda --world 1 \
        --halo --cells $cells --dtype float32 --warmup 30 --steps 5 --trace 200 2>&1 | quiet | grep -A3 "trace ("
    done
  done
  ;;
h1maceab)
  # MACE (random "medium", e3nn, fp32) with the halo forced on one GPU: the product
  # blocks on all rows (.ab_base) or on the owned rows only (this tree), alternated
  mace_leg() {
    timeout 200 python3 benchmarks/bench_mace.py --device cuda --modes dd1halo --start-cells "$1" \
      --doublings 0 --steps 5 --warmup 2 --dtypes float32 2>&1 | quiet | grep -E "^dd1halo|^plain|Error"
  }
  tree_legs "MACE fp32, halo forced on one GPU" "20 16" mace_leg
  ;;
h1fireab)
  # FIRE on one GPU: the host-deciding FIRE (.ab_base) against the device FIRE of
  # this tree, captured and eager, LJ argon fp64 (bench_ensembles timing), alternated
  fire_leg() {
    local kinds="fire fire-eager"
    [ "$2" = base ] && kinds="fire"
    # shellcheck disable=SC2086
    timeout 200 python3 benchmarks/bench_ensembles.py timing --device cuda --cells "$1" \
      --steps 200 --kinds $kinds 2>&1 | quiet | grep "ms/step"
  }
  tree_legs "FIRE, LJ argon fp64, one GPU" "32 63" fire_leg
  ;;
h1ljab)
  # the LJ step (peer, raw, DomainParallel on one GPU) of .ab_base against this tree,
  # legs alternated (the per-atom virial change made the Warp kernel a generated variant)
  lj_leg() {
    timeout 200 python3 benchmarks/bench_dp.py --device cuda --cells "$1" --dtype float32 float64 \
      --steps 100 --warmup 20 --worlds 1 2>&1 | quiet | grep -E "^(raw|DomainParallel|peer|LJ argon|neighbour)"
  }
  tree_legs "LJ argon, peer / raw / DomainParallel on one GPU" "32 63" lj_leg
  ;;
h1virials)
  # what LJConfig(atom_virials=True) costs the raw LJ step (and the DD step on one
  # GPU), legs alternated off / on, and the Warp variant kernel's GPU tests
  step "GPU tests of the per-atom virials"
  timeout 120 python3 -m pytest -p nvdd.testing.plugin -q --require-gpu -p no:cacheprovider \
    packages/nvdd-models/tests/test_models_lj_virials.py -k each_device 2>&1 | tail -3
  for cells in 63 32; do
    for leg in off on off on; do
      step "LJ argon cells=$cells, atom virials $leg"
      if [ "$leg" = on ]; then v=1; else v=0; fi
      NVDD_BENCH_ATOM_VIRIALS=$v timeout 120 python3 benchmarks/bench_dp.py --device cuda \
        --cells $cells --dtype float32 float64 --steps 100 --warmup 20 --worlds 1 --no-peer \
        2>&1 | quiet | grep -E "^(raw|DomainParallel|LJ argon)"
    done
  done
  ;;
x2big)
  step "largest LJ fp32 under DomainParallel on 2 GPUs (doubling until OOM)"
  timeout 230 python3 benchmarks/bench_dp.py --device cuda --largest --worlds 2 --dtype float32 \
    --start-cells 302 --json "$out/x2_largest.json" 2>&1 | quiet
  step "MACE medium fp32: plain (1 GPU) and DomainParallel on 2 GPUs, doubling until OOM"
  timeout 240 python3 benchmarks/bench_mace.py --device cuda --modes plain dd2 --start-cells 24 \
    --doublings 2 --steps 3 --warmup 1 --dtypes float32 --json "$out/x2_mace.json" 2>&1 | quiet | grep -v "UserWarning\|_Jd, _W3j\|cuequivariance or"
  step "PME 100k charges: raw, DomainParallel on 1 and 2 GPUs"
  timeout 110 python3 benchmarks/bench_pme.py --device cuda --atoms 100000 --worlds 1 2 2>&1 | quiet
  ;;
*)
  step "$phase"
  shift 2
  timeout 550 python3 "benchmarks/$phase.py" "$@" 2>&1 | quiet
  ;;
esac
step "done"
