#!/usr/bin/env bash
# Issue 17's runs on one 4-GPU machine, in two parts that each fit one device call (logs and JSON to $OUT, or
# runs/gpu_multi without it). The tiny-model tests share GPUs (they are small; their numbers do not depend on
# a neighbour); the benchmark runs alone.
#   scripts/gpu_multi.sh a   the 4-GPU layouts of tests/test_parallel_gpu.py while the dist_opt GPU tests
#                            run on GPUs 2,3; then the template twins on 4 GPUs while the 2-GPU SFT runs of
#                            tests/test_runtime_layouts.py use GPUs 2,3
#   scripts/gpu_multi.sh b   the 4-GPU bench (dp4 dense, ep4 MoE), alone on the machine
# Each piece has its own time limit, so one that hangs leaves the others' results.
set -uo pipefail
part=${1:?usage: scripts/gpu_multi.sh a|b}
out=${OUT:-runs/gpu_multi}
mkdir -p "$out"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
PYTEST=(python3 -m pytest -m gpu -p no:cacheprovider -rA --timeout 400)

bench() {  # bench GPUS LIMIT CASE...: one torchrun launch per case, so a slow one leaves the others' JSON
  local gpus=$1 limit=$2
  shift 2
  for case in "$@"; do
    timeout "$limit" torchrun --standalone --nproc-per-node "$gpus" -m mlite bench "$case" --steps 6 \
      --warmup 3 --out "$out/bench-$case.json" >"$out/bench-$case.log" 2>&1
    echo "bench $case: exit $?"; tail -6 "$out/bench-$case.log"
  done
}

case $part in
  a)
    CUDA_VISIBLE_DEVICES=2,3 timeout 250 "${PYTEST[@]}" tests/test_dist_opt.py >"$out/tests-dist-opt.log" 2>&1 &
    side=$!
    timeout 250 "${PYTEST[@]}" tests/test_parallel_gpu.py -k "xdp2 or xtp2" >"$out/tests-4gpu.log" 2>&1
    echo "4-GPU layouts: exit $?"; tail -8 "$out/tests-4gpu.log"
    wait $side; echo "dist_opt: exit $?"; tail -8 "$out/tests-dist-opt.log"
    CUDA_VISIBLE_DEVICES=2,3 timeout 300 "${PYTEST[@]}" \
      tests/test_runtime_layouts.py::test_sft_on_two_gpus_in_bf16_matches_one_gpu >"$out/tests-2gpu-sft.log" 2>&1 &
    side=$!
    timeout 300 "${PYTEST[@]}" tests/test_template_twins_gpu.py -s >"$out/tests-twins.log" 2>&1
    echo "twins: exit $?"; grep -E "worst relative|PASSED|FAILED|Error|passed|failed" "$out/tests-twins.log" | tail -30
    wait $side; echo "2-GPU SFT: exit $?"; tail -5 "$out/tests-2gpu-sft.log"
    ;;
  b)
    bench 4 190 dense-1.7b-4k-dp4 moe-30b-a3b-8l-4k-ep4
    ;;
  *) echo "usage: scripts/gpu_multi.sh a|b" >&2; exit 2 ;;
esac
