#!/usr/bin/env bash
# The C++ Llama against Hugging Face transformers (tests/models/hf_reference.py builds tiny random
# models locally; nothing is downloaded), at layouts of 1-4 ranks: logits of the loaded model,
# loss (label padding -100, uneven over data ranks) and every gradient of one step, every
# parameter after 3 AdamW steps; each export loads in transformers with its parameters and
# logits equal to transformers' own 3 steps. Grouped-query attention with fewer kv heads than tp
# is refused on every rank.
# usage: llama_parity_test.sh PARITY_MAIN PYTHON HF_REFERENCE_PY STEPS_SH
set -u
main="$1"; python="$2"; reference="$3"
source "$4"
# The reference's commands run in batches, one Python process each (batched_steps.sh): the three
# models first, every export check after the C++ layouts.
source "$(dirname "$0")/batched_steps.sh"

untied="$work/untied"; tied="$work/tied"; long="$work/long"
queue "transformers: an untied Llama with llama3 rope scaling, GQA 4:2, vocabulary 101" \
  make "$untied" --model llama --rope llama3
queue "transformers: a tied Llama" make "$tied" --model llama --tied
queue "transformers: the untied Llama on 24-token sequences (context parallel: 24 splits into 2 x cp pieces at cp 2, 3, 4)" \
  make "$long" --model llama --rope llama3 --time 24
run_queue "$python" "$reference"

# layout: ranks dp_replicate dp_shard tp pp microbatches loss_parallel vocab_multiple [ac] [sp]
run_layout() {
  local dir="$1" name="$2"; shift 2
  local n="$1" out="$dir/out-${name// /_}"
  mkdir -p "$out"
  step "$(basename "$dir") at $name: loaded, one step, 3 AdamW steps equal to transformers" \
    mpi "$n" "$main" "$dir/hf" "$dir/reference.safetensors" "$out" "${@:2}" &&
  queue "$(basename "$dir") at $name: its export loads in transformers, equal to transformers' training" \
    check "$dir" "$out/export" $( [ -f "$out/logits.safetensors" ] && echo "$out/logits.safetensors")
}
run_layout "$untied" "W=1"                     1 1 1 1 1 1 1 1
run_layout "$untied" "dp=2 microbatches=2"     2 1 2 1 1 2 1 1
run_layout "$untied" "tp=2 loss-parallel"      2 1 1 2 1 1 1 2
run_layout "$untied" "tp=2 gathered logits"    2 1 1 2 1 1 0 2
run_layout "$untied" "pp=2 1F1B"               2 1 1 1 2 2 1 1
run_layout "$untied" "dp=3"                    3 1 3 1 1 1 1 1
run_layout "$untied" "pp=3"                    3 1 1 1 3 3 1 1
run_layout "$untied" "dp=2 tp=2"               4 1 2 2 1 1 1 4
run_layout "$untied" "tp=2 sequence-parallel"  2 1 1 2 1 1 1 2 sp
run_layout "$untied" "pp=2 tp=2 sp, gathered"  4 1 1 2 2 2 0 2 sp
run_layout "$untied" "pp=2 dp=2"               4 1 2 1 2 2 1 1
run_layout "$untied" "pp=2 tp=2"               4 1 1 2 2 2 1 2
run_layout "$untied" "HSDP 2x2"                4 2 2 1 1 1 1 1
run_layout "$untied" "pp=2 dp=2 checkpointed"  4 1 2 1 2 2 1 1 ac
run_layout "$tied"   "W=1"                     1 1 1 1 1 1 1 1
run_layout "$tied"   "dp=2 tp=2 sp"            4 1 2 2 1 1 1 2 sp
# Context parallel (cp=N): each sequence's head-tail chunks on N ranks, ring attention.
run_layout "$long"   "cp=2"                    2 1 1 1 1 1 1 1 cp=2
run_layout "$long"   "cp=3"                    3 1 1 1 1 1 1 1 cp=3
run_layout "$long"   "cp=4"                    4 1 1 1 1 1 1 1 cp=4
run_layout "$long"   "cp=2 dp=2"               4 1 2 1 1 1 1 1 cp=2
run_layout "$long"   "cp=2 tp=2 sp"            4 1 1 2 1 1 1 2 sp cp=2
run_layout "$long"   "cp=2 pp=2 checkpointed"  4 1 1 1 2 2 1 1 ac cp=2
run_layout "$long"   "cp=2 HSDP 2x1"           4 2 1 1 1 1 1 1 cp=2
run_queue "$python" "$reference"

refused() {
  local log="$work/refused.log"
  if mpi 4 "$main" "$untied/hf" "$untied/reference.safetensors" "$work/refused" 1 1 4 1 1 1 4 > "$log" 2>&1; then
    echo "tp=4 with 2 kv heads was accepted"; return 1
  fi
  local n; n=$(grep -c "num_key_value_heads (grouped-query attention splits whole key/value heads) (2) must be divisible by the tensor-parallel size 4" "$log")
  echo "ranks that named the kv heads: $n"; [ "$n" -eq 4 ] || { cat "$log"; return 1; }
}
step "tp=4 with 2 kv heads: refused on every rank, naming num_key_value_heads" refused
refused_cp() {
  local log="$work/refused_cp.log"
  if mpi 3 "$main" "$untied/hf" "$untied/reference.safetensors" "$work/refused_cp" 1 1 1 1 1 1 1 cp=3 > "$log" 2>&1; then
    echo "cp=3 with 16-token sequences was accepted"; return 1
  fi
  local n; n=$(grep -c "forward_backward: step 1 refused on every rank: rank 0: .*T = 16 cannot be split over cp = 3.*2 \* cp = 6" "$log")
  echo "ranks that named the sequence length: $n"; [ "$n" -eq 3 ] || { grep -v "^\[" "$log" | head -5; return 1; }
}
step "cp=3 with 16-token sequences (not 2 x cp pieces): refused on every rank before anything communicates" refused_cp
finish llama_parity_test
