# shellcheck shell=bash
# The launch environment every mlite launcher and Slurm template shares. Sourced, never run.
# Each variable keeps a value already set in the environment, so any one can be overridden per job.

# --- CUDA and the PyTorch allocator
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}    # one hardware queue: TP/CP comm overlaps compute in issue order
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # less fragmentation with packed, variable-length batches
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}  # free comm buffers promptly instead of at stream sync

# --- NCCL: known hangs off, timeouts raised and named
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}                          # NVLink SHARP has known hangs; opt in per job
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                                    # INFO when chasing a hang
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}                            # InfiniBand retry timeout exponent (4.096 us x 2^22 ~ 17 s)
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}                         # InfiniBand retries before a link error
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}  # on a collective timeout: tear down and exit, never hang
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1200}  # watchdog of the NCCL watchdog (first steps can be slow)
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}       # flight-recorder dump names the collective that hung
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}    # flight recorder: collectives kept for that dump

# --- torchrun: how long nodes wait for each other at start
export RDZV_TIMEOUT_S=${RDZV_TIMEOUT_S:-600}                             # static rendezvous on the first node: all nodes must join within this

# --- Ray (GRPO): large jobs need longer health checks than Ray's defaults
export RAY_health_check_timeout_ms=${RAY_health_check_timeout_ms:-30000}    # one missed health check is not a dead node
export RAY_health_check_failure_threshold=${RAY_health_check_failure_threshold:-10}  # consecutive misses before a node is declared dead
export RAY_gcs_rpc_server_reconnect_timeout_s=${RAY_gcs_rpc_server_reconnect_timeout_s:-120}  # workers wait this long for a busy head
export RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-0}                               # every rank's lines in the node logs
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}             # clusters without internet: no usage report
# Ray's token authentication (https://docs.ray.io/en/latest/ray-security/token-auth.html): without it anyone who
# reaches a Ray port can run code as this user. One explicit mode for every node (Ray >= 2.5x guesses it from
# ~/.ray/auth_token, differently on the head and the workers). Every node must read the same token: under Slurm
# slurm/lib/job.sh makes one per job (RAY_AUTH_TOKEN_PATH); a local ray.init() makes ~/.ray/auth_token.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

# --- torch.compile's caches: Inductor's compiled graphs and Triton's kernels (with their autotuning choices) in
# one place that outlives the job, so a restart, a requeue or the next job of the same model loads them
# instead of compiling again (Triton's defaults are node-local: /tmp, ~/.triton). Both write each entry by
# an atomic rename, so ranks and nodes can share the folder. MLITE_COMPILE_CACHE moves both.
MLITE_COMPILE_CACHE=${MLITE_COMPILE_CACHE:-$HOME/.cache/mlite/compile}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$MLITE_COMPILE_CACHE/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$MLITE_COMPILE_CACHE/triton}

# --- Python and tokenizers
export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}                           # log lines appear as they happen
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}           # no fork warnings from HF tokenizers in data workers
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}                             # one thread per rank unless a job asks for more
