#!/usr/bin/env bash
# Any entry point under OpenMPI's mpirun: one process per GPU, ranks from OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK
# (rlhf.distributed.DistEnv). The first argument names the entry point (sft, rm, ppo, dpo, kto, ... for
# launch/<name>.py); the rest are its flags:
#
#   NP=8 PYTHON=.venv/bin/python bash launch/mpirun.sh sft --pretrain <HF dir> --dataset sft.jsonl \
#       --input_key input --output_key output --save_path out/sft --tensor_model_parallel_size 8
#   NP=16 MASTER_ADDR=node001 MPIRUN_ARGS="--hostfile hosts --map-by ppr:8:node --bind-to none" \
#       PYTHON=.venv/bin/python bash launch/mpirun.sh ppo --pretrain <actor HF dir> \
#       --reward_pretrain <RM HF dir> --prompt_data prompts.jsonl --input_key prompt --save_path out/ppo \
#       --bf16 --tensor_model_parallel_size 4 --vllm_tensor_parallel_size 4
#
# launch/mpirun_{sft,rm,ppo}.sh are this script with the first argument given. ENTRY (a Python file) overrides the
# entry point the name picks. MASTER_ADDR must be the host of rank 0 (the first slot of the hostfile). mpirun
# forwards to other nodes only the variables named with -x: add `-x NAME` to MPIRUN_ARGS for any other variable you
# set. As root (containers) add --allow-run-as-root; with more ranks than cores (CPU tests) add --oversubscribe.
set -euo pipefail

export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
NP=${NP:-8}
PYTHON=${PYTHON:-python3}
NAME=${1:?usage: mpirun.sh sft|rm|ppo|dpo|kto|... [flags of launch/NAME.py]}
shift
ENTRY=${ENTRY:-$(dirname "$0")/$NAME.py}  # the Python entry point each rank runs
MPIRUN_ARGS=${MPIRUN_ARGS:---bind-to none --map-by slot}
# NCCL and torch.distributed: overridable defaults, one per line (set any of them before launching to change it).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                             # INFO: print topology, rings and the NICs chosen
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^docker,lo}       # bootstrap/socket NIC, e.g. eth0, bond0, ib0
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}                           # InfiniBand/RoCE adapters, by name prefix
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}                      # 1: no InfiniBand, TCP sockets only
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}                     # IB retry timeout 4.096us*2^N; raise on big fabrics
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # abort on a NCCL error, no hang
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}          # megatron: ordered TP comm/compute
# export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}                # RoCE v2 only (NCCL >= 2.21 finds it itself)

# MPIRUN_ARGS is split into words on purpose.
# shellcheck disable=SC2086
exec mpirun -np "$NP" $MPIRUN_ARGS -x MASTER_ADDR -x MASTER_PORT -x OMP_NUM_THREADS -x PATH \
    -x NCCL_DEBUG -x NCCL_SOCKET_IFNAME -x NCCL_IB_HCA -x NCCL_IB_DISABLE -x NCCL_IB_TIMEOUT \
    -x TORCH_NCCL_ASYNC_ERROR_HANDLING -x CUDA_DEVICE_MAX_CONNECTIONS \
    "$PYTHON" "$ENTRY" "$@"
