#!/usr/bin/env bash
# The one script to run when a CUDA machine is at hand (see bench/gpu_check.py):
# correctness on CUDA tensors (models vs Hugging Face, fused cross-entropy, SDPA paths, ZeRO with
# world size 1, generation), then a bf16 gpt-1.3b training step (seq 2048) with MFU and peak
# memory against the planner, torch.compile off and on. Refuses politely without CUDA.
# PYTHON=/path/to/python picks the interpreter (default python3).
#   bash bench/gpu_check.sh [--skip-step] [--micro-batch-size 4] [--steps 5]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m bench.gpu_check "$@"
