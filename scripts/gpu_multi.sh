#!/usr/bin/env bash
# Run the multi-GPU tests and benchmarks on one 4-GPU machine, part by part.
# Each part fits one device call (logs and JSON to $OUT, or runs/gpu_multi without it). The tiny-model tests share GPUs (they are small; their numbers do not depend on
# a neighbour); the benchmark runs alone.
#   scripts/gpu_multi.sh tests   at once: the 4-GPU layouts of tests/test_parallel_gpu.py; the dist_opt GPU
#                                tests and the 2-GPU SFT runs on GPUs 2,3; the template twins on 4 GPUs
#                                (TWINS_K, TWO_K: pytest -k filters; LIMIT: seconds per stream)
#   scripts/gpu_multi.sh dist_opt  tests/test_dist_opt.py's twelve GPU tests in four streams, two on GPUs 0,1 and two
#                                on 2,3; a worker alive after 150 s writes its stacks to $out/hang-*.txt
#                                (scripts/hang_dump)
#   scripts/gpu_multi.sh bench   the 4-GPU bench (dp4 dense, ep4 MoE; CASES: others, e.g. their -dist-opt twins),
#                                alone on the machine (LIMIT per case; NUMA=exclusive: each rank bound to
#                                its own cores by torchrun --numa-binding, the A/B for a host-late rank)
#   scripts/gpu_multi.sh profile the same two cases (CASES: others) through scripts/profile_step.py (LIMIT per case;
#                                SET: job keys as profile_step.py's --set)
#   scripts/gpu_multi.sh ab      a paired A/B of one job key on the 4-GPU MoE case (scripts/ab_step.py
#                                --interleave): the ep exchange's pair buffers counted on the host against
#                                sized for the worst case (AB_CASE, AB_KEY: another case or key)
#   scripts/gpu_multi.sh vllm    GRPO with vLLM over the ranks (tests/test_vllm_gpu.py -k several_gpus, 2 and 4
#                                GPUs), then the 2-GPU rollout bench: 2 engines of tp1 on GPUs 0,1 beside one of
#                                tp2 on GPUs 2,3 (carry .whl and .vllm1: scripts/vllm_bundle.sh)
#   scripts/gpu_multi.sh vllm_v4 2 GPUs: GRPO of small-deepseek-v4 (after 40 SFT steps) under ep2 rolling out on
#                                one vLLM engine of rollout.tp 2 with expert parallel (K: the pytest -k filter;
#                                the other dsv4 engine shapes, one a call). Two calls:
#                                the first carries .vllmv41 and runs `bash scripts/gpu_vllm_env.sh stash`; the
#                                second, while the machine is warm, carries .vllmv42, .vllm1 and .whl and runs this
#   scripts/gpu_multi.sh vllm1   one GPU is enough: the single-GPU vLLM tests (GRPO steps, the demo's GRPO stage),
#                                then verl's main_ppo with the mlite actor and verl's vLLM rollout (carry .vllm1,
#                                .verl1, mlite.egg-info and the pydantic wheels: scripts/gpu_verl_env.sh)
# GPUS (default 4) sets the ranks of bench, profile and ab, e.g. GPUS=2 CASES=moe-30b-a3b-8l-4k-ep2 on two GPUs.
# Each piece has its own time limit, so one that hangs leaves the others' results.
set -uo pipefail
part=${1:?usage: scripts/gpu_multi.sh tests|dist_opt|bench|profile|ab|vllm|vllm_v4|vllm1}
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
    # shellcheck disable=SC2086  # NUMA: torchrun's --numa-binding mode (exclusive, node, ...), or none
    timeout "$limit" torchrun --standalone --nproc-per-node "$gpus" ${NUMA:+--numa-binding $NUMA} -m mlite bench \
      "$case" --steps "${STEPS:-6}" --warmup 3 --out "$out/bench-$case${NUMA:+-numa-$NUMA}.json" \
      >"$out/bench-$case${NUMA:+-numa-$NUMA}.log" 2>&1
    echo "bench $case: exit $?"; tail -6 "$out/bench-$case.log"
  done
}

case $part in
  tests)  # three streams at once (tiny models: they share GPUs; the numbers are each run's own)
    timeout "${LIMIT:-400}" "${PYTEST[@]}" tests/test_parallel_gpu.py -k "xdp2 or xtp2" \
      >"$out/tests-4gpu.log" 2>&1 &
    four=$!
    (CUDA_VISIBLE_DEVICES=2,3 timeout "${LIMIT:-400}" "${PYTEST[@]}" tests/test_dist_opt.py \
       tests/test_runtime_layouts.py::test_sft_on_two_gpus_in_bf16_matches_one_gpu -k "${TWO_K:-not nothing}" \
       >"$out/tests-2gpu.log" 2>&1) &
    two=$!
    timeout "${LIMIT:-400}" "${PYTEST[@]}" tests/test_template_twins_gpu.py -s -k "${TWINS_K:-not eight_gpus}" \
      >"$out/tests-twins.log" 2>&1
    echo "twins: exit $?"; grep -E "worst relative|PASSED|FAILED|passed|failed" "$out/tests-twins.log" | tail -20
    wait $four; echo "4-GPU layouts: exit $?"; grep -E "PASSED|FAILED|passed|failed" "$out/tests-4gpu.log" | tail -8
    wait $two; echo "2-GPU tests: exit $?"; grep -E "PASSED|FAILED|passed|failed" "$out/tests-2gpu.log" | tail -8
    ;;
  dist_opt)  # tests/test_dist_opt.py's GPU tests in four 2-GPU streams, two on each pair of GPUs (tiny models)
    export PYTHONPATH="$PWD/scripts/hang_dump:$PYTHONPATH" MLITE_HANG_DUMP_DIR="$out"
    D=tests/test_dist_opt.py
    T=$D::test_dist_opt_trains_a_layout_like_one_gpu_and_resumes
    streams=(
      "0,1|$D::test_dist_opt_dp2_matches_fsdp2_and_one_gpu_in_bf16 $D::test_two_deterministic_dist_opt_runs_are_bitwise_identical $D::test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank"
      "0,1|${T}[dense-tp2] ${T}[dense-pp2] ${T}[dense-pp2-vpp2]"
      "2,3|${T}[dense-dp2] ${T}[moe-ep2]"
      "2,3|${T}[moe-pp2] ${T}[moe-tp2] ${T}[tied-tp2]"
    )
    pids=()
    for i in "${!streams[@]}"; do
      gpus=${streams[$i]%%|*}
      read -r -a args <<<"${streams[$i]#*|}"
      (CUDA_VISIBLE_DEVICES=$gpus timeout "${LIMIT:-540}" "${PYTEST[@]}" "${args[@]}" \
         >"$out/dist_opt-$i.log" 2>&1) &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}"; echo "dist_opt stream $i: exit $?"; grep -E "PASSED|FAILED|passed|failed" "$out/dist_opt-$i.log"
    done
    find "$out" -name 'hang-*.txt' -empty -delete
    ls "$out"/hang-*.txt 2>/dev/null
    ;;
  bench)  # alone on the machine
    # shellcheck disable=SC2086  # CASES: one case per word
    bench "${GPUS:-4}" "${LIMIT:-190}" ${CASES:-dense-1.7b-4k-dp4 moe-30b-a3b-8l-4k-ep4}
    ;;
  profile)  # where the multi-GPU step's time goes (rank 0's kernels, NCCL apart), alone on the machine
    # shellcheck disable=SC2086  # CASES: one case per word
    for case in ${CASES:-dense-1.7b-4k-dp4 moe-30b-a3b-8l-4k-ep4}; do
      # shellcheck disable=SC2086  # SET: job keys for every case, e.g. "--set precision.fp8_linears=all"
      timeout "${LIMIT:-200}" torchrun --standalone --nproc-per-node "${GPUS:-4}" scripts/profile_step.py "$case" \
        ${SET:-} >"$out/profile-$case.txt" 2>&1
      echo "profile $case: exit $?"; grep -E "^step|^rank 0|^compiled|^host" "$out/profile-$case.txt"
    done
    ;;
  ab)  # alone on the machine: both variants built once, taking turns in short blocks
    timeout "${LIMIT:-420}" torchrun --standalone --nproc-per-node "${GPUS:-4}" scripts/ab_step.py \
      "${AB_CASE:-moe-30b-a3b-8l-4k-ep4}" --interleave --rounds 8 --steps 3 --variant "" \
      --variant "${AB_KEY:-parallel.expert_buffers=worst_case}" >"$out/ab.log" 2>&1
    echo "ab: exit $?"; tail -12 "$out/ab.log"
    ;;
  vllm)  # the tests use every GPU in turn; the two rollout benches share the machine, two GPUs each
    # shellcheck source=scripts/gpu_vllm_env.sh
    . scripts/gpu_vllm_env.sh
    timeout "${LIMIT:-420}" "${PYTEST[@]}" -m vllm tests/test_vllm_gpu.py -s -k "several_gpus and not dsv4" \
      >"$out/vllm-tests.log" 2>&1
    echo "vllm tests: exit $?"; grep -E " step: |PASSED|FAILED|passed|failed" "$out/vllm-tests.log" | tail -20
    for tp in 1 2; do
      gpus=$([ "$tp" = 1 ] && echo 0,1 || echo 2,3)
      (CUDA_VISIBLE_DEVICES=$gpus timeout "${LIMIT:-330}" torchrun --nproc-per-node 2 \
         --rdzv-backend c10d --rdzv-endpoint "localhost:$((29500 + tp * 11))" \
         scripts/rollout_bench.py qwen3-1.7b --tp "$tp" >"$out/rollout-bench-tp$tp.log" 2>&1) &
    done
    wait; grep -h '^{' "$out"/rollout-bench-tp*.log
    ;;
  vllm_v4)  # the V4 add-on unpacks on top of the main bundle; the first use compiles tilelang's mHC kernels
    # shellcheck source=scripts/gpu_vllm_env.sh
    . scripts/gpu_vllm_env.sh
    timeout "${LIMIT:-540}" "${PYTEST[@]}" --timeout 530 -m vllm tests/test_vllm_gpu.py -s \
      -k "${K:-dsv4-ep2-rollout-tp2 and not split}" \
      >"$out/vllm-v4-tests.log" 2>&1
    echo "vllm V4 tests: exit $?"; grep -E " step: |PASSED|FAILED|passed|failed" "$out/vllm-v4-tests.log" | tail -8
    ;;
  vllm1)  # one GPU: mlite's own vLLM path, then verl's
    # shellcheck source=scripts/gpu_vllm_env.sh
    . scripts/gpu_vllm_env.sh
    # shellcheck source=scripts/gpu_verl_env.sh
    . scripts/gpu_verl_env.sh || exit 1
    timeout "${LIMIT:-300}" "${PYTEST[@]}" -m vllm tests/test_vllm_gpu.py -s -k "not several_gpus" \
      >"$out/vllm1-tests.log" 2>&1
    echo "vllm tests: exit $?"; grep -E " step: |PASSED|FAILED|passed|failed" "$out/vllm1-tests.log" | tail -12
    timeout "${LIMIT:-300}" "${PYTEST[@]}" -m "gpu and vllm" tests/test_verl_grpo.py -s >"$out/verl-vllm.log" 2>&1
    echo "verl main_ppo + vLLM: exit $?"; grep -E "^step [0-9]|PASSED|FAILED|passed|failed" "$out/verl-vllm.log"
    ;;
  *) echo "usage: scripts/gpu_multi.sh tests|dist_opt|bench|profile|ab|vllm|vllm_v4|vllm1" >&2; exit 2 ;;
esac
