#!/usr/bin/env bash
# Rerun every benchmark in bench/ that exists, one after another (they share the CPU, so never
# in parallel); each writes its JSON (and PNG where it draws one) under bench/results/.
#
#   bash bench/run_all.sh              # everything (~25 min on 2 cores)
#   bash bench/run_all.sh train_step   # only the scripts whose name contains a word given
#
# The ZeRO-vs-DeepSpeed benchmark needs DeepSpeed in a separate virtual environment (see its
# docstring); set DS_PYTHON=/path/to/that/python to include it, otherwise it is skipped.
# The preprocessing benchmark compares with Megatron-LM's own tool when MEGATRON_LM names a
# checkout of it (otherwise that column is skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
failed=()
want() {  # no filter words, or one of them is in the script's name
  [ $# -eq 1 ] && return 0
  local name=$1; shift
  for w in "$@"; do [[ $name == *"$w"* ]] && return 0; done
  return 1
}
for script in bench/bench_*.py; do
  name=$(basename "$script" .py)
  want "$name" "$@" || continue
  args=()
  if [[ $name == bench_zero_vs_deepspeed ]]; then
    if [[ -z ${DS_PYTHON:-} ]]; then echo "== $name: skipped (set DS_PYTHON)"; continue; fi
    args=(--ds-python "$DS_PYTHON")
    export DS_ACCELERATOR=cpu
  fi
  if [[ $name == bench_preprocess && -n ${MEGATRON_LM:-} ]]; then
    args=(--megatron-lm "$MEGATRON_LM")  # a Megatron-LM checkout (see the script's docstring)
  fi
  echo "== $name $(date +%H:%M:%S)"
  start=$SECONDS
  if ! "$PY" -m "bench.$name" "${args[@]}"; then failed+=("$name"); fi
  if [[ $name == bench_zero_vs_deepspeed ]]; then  # ZeRO-2/3 against DeepSpeed and FSDP2, fp32 and bf16
    "$PY" -m "bench.$name" "${args[@]}" --dtype fp32 --stages 2 3 --fsdp2 \
      --out bench/results/zero_vs_peers_fp32 || failed+=("$name (fp32)")
    "$PY" -m "bench.$name" "${args[@]}" --dtype bf16 --stages 2 3 --fsdp2 \
      --out bench/results/zero_vs_peers_bf16 || failed+=("$name (bf16)")
  fi
  if [[ $name == bench_train_step ]]; then  # and at a GPT-2-sized vocabulary and width
    "$PY" -m "bench.$name" --hidden 768 --layers 6 --heads 12 --vocab 50257 --seq 512 --batch 1 \
      --rounds 3 --out bench/results/train_step_gpt2_vocab || failed+=("$name (gpt2 vocab)")
    # the loss-heavy shape: narrow model, GPT-2 vocabulary, 2048 tokens a step
    "$PY" -m "bench.$name" --hidden 256 --layers 4 --heads 8 --vocab 50257 --seq 256 --batch 8 \
      --rounds 5 --out bench/results/train_step_h256_gpt2_vocab || failed+=("$name (h256)")
  fi
  echo "== $name done in $((SECONDS - start)) s"
done
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all benchmarks done; results in bench/results/"
