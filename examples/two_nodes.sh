#!/usr/bin/env bash
# Serve one model over two machines, 4 GPUs each (tensor parallel size 8). Run this same script on both
# machines with NODE_RANK=0 on the first (it serves HTTP) and NODE_RANK=1 on the second:
#
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 IFACE=enp1s0 bash examples/two_nodes.sh /models/Llama-3-70B
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 IFACE=enp1s0 bash examples/two_nodes.sh /models/Llama-3-70B
#
# The ranks authenticate each other with a shared secret: export the same SHARDSERVE_CONTROL_TOKEN on both
# machines first (e.g. from `python3 -c 'import secrets; print(secrets.token_hex(32))'`).
#
# Variables that change NCCL's behaviour are passed with --forward-env: the values set on node 0
# reach every rank, so they cannot differ between the machines. Start-up stops with a message naming
# any other difference (code, versions, config, NCCL_*/GLOO_*/CUDA_*/TORCH_* variables).
set -euo pipefail
MODEL=${1:?usage: NODE_RANK=R MASTER_ADDR=HOST bash examples/two_nodes.sh MODEL}
: "${NODE_RANK:?set NODE_RANK to 0 on the first machine, 1 on the second}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first machine}"
: "${SHARDSERVE_CONTROL_TOKEN:?set SHARDSERVE_CONTROL_TOKEN to the same secret on both machines}"
MASTER_PORT=${MASTER_PORT:-29500}
IFACE=${IFACE:-}

export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

exec shardserve serve "$MODEL" -tp 8 \
    --nnodes 2 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    ${IFACE:+--control-interface "$IFACE"} \
    --forward-env NCCL_IB_DISABLE NCCL_DEBUG \
    --host 0.0.0.0 --port 8000
