#!/usr/bin/env bash
# The C++ Qwen3-MoE (models/moe.h) against Hugging Face transformers (tests/models/moe_reference.py
# builds tiny random models locally; nothing is downloaded), at layouts of 1-4 ranks: logits and
# auxiliary loss of the loaded model, the routing (top-k ids and weights, token by token), loss
# (cross-entropy + router_aux_loss_coef x aux, label padding -100) and every gradient of one step,
# every parameter and buffer after 3 AdamW steps; each export loads in transformers with its
# parameters and logits equal to transformers' own 3 steps. Two models: transformers'
# Qwen3MoeForCausalLM, and a hybrid whose sparse blocks are transformers' DeepseekV3MoE (sigmoid
# scores, e_score_correction_bias updated after each step, group-limited top-k, routed scaling, a
# shared expert) behind a dense first layer. Rows 6-11 of the batch repeat one token, so every
# token there routes alike and most experts get no row: the layouts marked "empty" hold such a
# slice on some rank in the step's last forward and must report experts called with no row. tp=4
# with 2 kv heads is refused on every rank. One layout runs with activation checkpointing.
# usage: moe_parity_test.sh PARITY_MAIN PYTHON MOE_REFERENCE_PY STEPS_SH
set -u
main="$1"; python="$2"; reference="$3"
source "$4"
# The reference's commands run in batches, one Python process each (batched_steps.sh): the two
# models first, every export check after the C++ layouts.
source "$(dirname "$0")/batched_steps.sh"

qwen3="$work/qwen3"; deepseek="$work/deepseek"
queue "transformers: a Qwen3-MoE (8 experts, top-2, norm_topk_prob, 4 layers, hidden 32, vocabulary 101)" \
  make "$qwen3" --variant qwen3
queue "transformers: the same with DeepseekV3MoE blocks (sigmoid, bias, 4 groups / 2, scaling 2.5, shared expert)" \
  make "$deepseek" --variant deepseek
run_queue "$python" "$reference"

# layout: ranks dp_replicate dp_shard tp pp microbatches loss_parallel vocab_multiple [flags]
# flags: "empty": some rank must have called some expert with no row; "ac": activation
# checkpointing (the spec's policy: attention and MLPs); "ep=N": the experts split over N
# expert-parallel ranks taken from dp_shard (tokens dispatched by all-to-all; the export written
# by each ep rank's first holder, one file each).
run_layout() {
  local dir="$1" name="$2"; shift 2
  local n="$1" out="$dir/out-${name// /_}" log
  local k=$(( $2 * $3 * $6 ))
  mkdir -p "$out"; log="$out/log"
  check_main() {
    local flags=" ${*:9} " rc
    mpi "$n" "$main" "$dir/hf" "$dir/reference.safetensors" "$out" "${@:2:7}" \
      $( [[ "$flags" == *" ac "* ]] && echo ac ) $(for f in $flags; do [[ "$f" == ep=* ]] && echo "$f"; done) > "$log" 2>&1
    rc=$?
    grep -v "^\[" "$log" | grep -v "^ *$" | grep -v -- "^---" | head -40
    [ "$rc" -eq 0 ] || return 1
    if [[ "$flags" == *" empty "* ]]; then
      grep -q "empty expert calls over the job: [1-9]" "$log" || { echo "no rank called an expert with no row"; return 1; }
    fi
  }
  step "$(basename "$dir") at $name: loaded, routing, one step, 3 AdamW steps equal to transformers" check_main "$@" &&
  queue "$(basename "$dir") at $name: its export loads in transformers, equal to transformers' training" \
    check "$dir" "$out/export" "$k" $( [ -f "$out/logits.safetensors" ] && echo "$out/logits.safetensors")
}
run_layout "$qwen3"    "W=1"                  1 1 1 1 1 1 1 1
run_layout "$qwen3"    "dp=2"                 2 1 2 1 1 1 1 1 empty
run_layout "$qwen3"    "tp=2 loss-parallel"   2 1 1 2 1 1 1 2
run_layout "$qwen3"    "pp=2 1F1B"            2 1 1 1 2 2 1 1 empty
run_layout "$qwen3"    "dp=3"                 3 1 3 1 1 1 1 1 empty
run_layout "$qwen3"    "dp=2 tp=2"            4 1 2 2 1 1 0 2 empty
run_layout "$qwen3"    "pp=2 dp=2"            4 1 2 1 2 2 1 1 empty
run_layout "$qwen3"    "ep=2"                 2 1 2 1 1 1 1 1 empty ep=2
run_layout "$qwen3"    "ep=4"                 4 1 4 1 1 1 1 1 empty ep=4
run_layout "$qwen3"    "dp=4 ep=2"            4 1 4 1 1 1 1 1 empty ep=2
run_layout "$qwen3"    "HSDP 2x2 ep=2"        4 2 2 1 1 1 1 1 empty ep=2
run_layout "$deepseek" "W=1"                  1 1 1 1 1 1 1 1
run_layout "$deepseek" "dp=2 tp=2 ac"         4 1 2 2 1 1 1 2 empty ac
run_layout "$deepseek" "pp=2 dp=2"            4 1 2 1 2 2 1 1 empty
run_layout "$deepseek" "ep=2 tp=2 ac"         4 1 2 2 1 1 1 2 empty ac ep=2
run_layout "$deepseek" "ep=2 pp=2"            4 1 2 1 2 2 1 1 empty ep=2
run_queue "$python" "$reference"

refused() {
  local log="$work/refused.log"
  if mpi 4 "$main" "$qwen3/hf" "$qwen3/reference.safetensors" "$work/refused" 1 1 4 1 1 1 4 > "$log" 2>&1; then
    echo "tp=4 with 2 kv heads was accepted"; return 1
  fi
  local n; n=$(grep -c "num_key_value_heads (grouped-query attention splits whole key/value heads) (2) must be divisible by the tensor-parallel size 4" "$log")
  echo "ranks that named the kv heads: $n"; [ "$n" -eq 4 ] || { cat "$log"; return 1; }
}
step "tp=4 with 2 kv heads: refused on every rank, naming num_key_value_heads" refused
refused_ep() {
  local log="$work/refused_ep.log"
  if mpi 3 "$main" "$qwen3/hf" "$qwen3/reference.safetensors" "$work/refused_ep" 1 3 1 1 1 1 1 ep=3 > "$log" 2>&1; then
    echo "ep=3 with 8 experts was accepted"; return 1
  fi
  local n; n=$(grep -c "num_experts (8) must be divisible by the expert-parallel size 3" "$log")
  echo "ranks that named num_experts: $n"; [ "$n" -eq 3 ] || { cat "$log"; return 1; }
}
step "ep=3 with 8 experts: refused on every rank before anything is sharded, naming num_experts" refused_ep
finish moe_parity_test
