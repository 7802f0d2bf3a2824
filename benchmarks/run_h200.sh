#!/usr/bin/env bash
# The single-GPU measurements and GPU tests of docs/benchmarks.md, as run on one
# H200 (torch 2.11+cu130, Python 3.12, warp-lang 1.19 and vesin 0.6.2 carried in).
# Usage (repository root, warp importable): bash benchmarks/run_h200.sh OUTDIR
set -uo pipefail
out="${1:-/tmp/nvdd-h200}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$(ls -d packages/*/src | tr '\n' ':')"
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
nvidia-smi topo -m > "$out/topo.txt" 2>&1; cat "$out/topo.txt"
python3 -c "import torch, warp; print('torch', torch.__version__, 'warp', warp.__version__)"
step "GPU tests (-m gpu --require-gpu)"
python3 -m pytest -p nvdd.testing.plugin -q -m gpu --require-gpu -p no:cacheprovider \
  packages/nvdd-halo/tests packages/nvdd-models/tests packages/nvdd-padding/tests \
  packages/nvdd-shardtensor/tests packages/nvdd-partition/tests 2>&1 | tail -8
step "integration suite over NCCL, 1 rank (multi-GPU kinds not lent)"
python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
  integration_tests/multigpu_suite.py --allow-single 2>&1 | grep -E "PASS|FAIL|scenarios|Error" 
step "DD wrapper at 1 GPU vs the raw integrator: LJ argon 1.02M atoms"
python3 benchmarks/bench_dp.py --device cuda --cells 63 --steps 40 --warmup 10 --worlds 1 \
  --dtype float32 --json "$out/dp_f32.json" 2>&1 | grep -v -i "warp\|module"
python3 benchmarks/bench_dp.py --device cuda --cells 63 --steps 40 --warmup 10 --worlds 1 \
  --dtype float64 --json "$out/dp_f64.json" 2>&1 | grep -v -i "warp\|module"
step "issue 13: nvdd vs the nvalchemi-toolkit-ops peer loop (same system, same run), 4k to 4M atoms"
python3 benchmarks/bench_dp.py --device cuda --cells 10 32 63 100 --dtype float32 float64 \
  --lj-list half full --steps 100 --warmup 20 --worlds 1 --json "$out/peer.json" 2>&1 \
  | grep -v -i "warp\|module"
step "issue 13: the largest LJ fp32 system one GPU holds"
python3 benchmarks/bench_dp.py --device cuda --largest --dtype float32 --json "$out/largest.json" \
  2>&1 | grep -v -i "warp\|module"
step "halo kernels: throughput"
python3 benchmarks/bench_halo.py --mode kernels --device cuda --sizes 1e6 4e6 --repeats 5 2>&1 \
  | grep -v -i "module\|warp " | tail -25
step "done"
