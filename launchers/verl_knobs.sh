# shellcheck shell=bash
# shellcheck disable=SC2034  # every knob is read by the launcher that sources this file
# The knobs launchers/verl_sft.sh and launchers/verl_grpo.sh share. Sourced by them after their own knobs,
# never run. Every knob is an environment variable: a value set in the environment wins over the default.

# --- layout (mlite engine knobs; dp is what is left of the world size)
TP=${TP:-1}                               # tensor parallel
PP=${PP:-1}                               # pipeline stages
CP=${CP:-1}                               # context parallel
EP=${EP:-1}                               # expert parallel
DTYPE=${DTYPE:-bfloat16}                  # compute dtype (master weights stay fp32)
OFFLOAD_PARAMS=${OFFLOAD_PARAMS:-false}   # parameters on the host between phases
OFFLOAD_OPTIMIZER=${OFFLOAD_OPTIMIZER:-false}  # optimizer state on the host between phases
# --- launcher behaviour
PYTHON=${PYTHON:-python}                  # interpreter with mlite[verl] installed
EXTRA_ARGS=${EXTRA_ARGS:-}                # more Hydra overrides, space-separated
DRY_RUN=${DRY_RUN:-0}                     # 1: print the resolved command, start nothing
