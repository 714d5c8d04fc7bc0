#!/usr/bin/env bash
# The language-model example end to end: a Llama trained from scratch on the shipped token file at dp=2 and exported
# as a Hugging Face folder, then started from that folder at (dp, tp) = (2, 2) and (pp, dp) =
# (2, 2); a Qwen3-MoE the same way; every run's losses match the same training unsharded on one
# process.
# docs/composition.md's program (examples/llama_finetune.cc) fine-tunes the export at (dp, tp) = (2, 2).
# usage: train_lm_test.sh TRAIN_LM TOKEN_FILE STEPS_SH LLAMA_FINETUNE
set -u
main="$1"; tokens="$2"; finetune="$4"
source "$3"
export OMPI_MCA_rmaps_base_oversubscribe=1
run() {
  local log="$work/run.log"
  mpi "$@" > "$log" 2>&1; local rc=$?
  grep -E "^(step|final|exported|train_lm)" "$log"
  [ $rc -eq 0 ] && grep -q "match$" "$log"
}
step "from scratch at dp=2, exported" run 2 "$main" --data "$tokens" --steps 10 --export-hf "$work/hf"
step "the export has config.json and model.safetensors" test -s "$work/hf/config.json" -a -s "$work/hf/model.safetensors"
step "from the export at (dp, tp) = (2, 2), sequence parallel" run 4 "$main" --data "$tokens" --steps 6 --dp 2 --tp 2 \
  --sequence-parallel --hf-init "$work/hf"
step "from the export at (pp, dp) = (2, 2)" run 4 "$main" --data "$tokens" --steps 6 --pp 2 --dp 2 --hf-init "$work/hf" \
  --export-hf "$work/hf2"
step "the pipelined export has an index and one file per stage" \
  test -s "$work/hf2/model.safetensors.index.json" -a -s "$work/hf2/model-00002-of-00002.safetensors"
finetuned() {
  mpi 4 "$finetune" "$work/hf" "$tokens" "$work/tuned" || return 1
  test -s "$work/tuned/config.json" -a -s "$work/tuned/model.safetensors"
}
step "docs/composition.md's llama_finetune on the export at (dp, tp) = (2, 2)" finetuned
refused() {
  local log="$work/refused.log"
  printf '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}' > "$work/hf2/config.json"
  if mpi 2 "$main" --data "$tokens" --steps 1 --hf-init "$work/hf2" > "$log" 2>&1; then echo "accepted"; return 1; fi
  cat "$log" | head -3
  [ "$(grep -c "key 'model_type' is \"gpt2\", expected \"llama\"" "$log")" -ge 1 ]
}
step "a folder of another architecture is refused, naming the key" refused
step "MoE from scratch at (pp, dp) = (2, 2): sigmoid scores, bias updates, a shared expert, aux loss; exported" \
  run 4 "$main" --model moe --data "$tokens" --steps 6 --pp 2 --dp 2 --scoring sigmoid --shared-experts 1 \
  --export-hf "$work/moe"
step "MoE from its export at (dp, tp) = (2, 2)" run 4 "$main" --model moe --data "$tokens" --steps 4 --dp 2 --tp 2 \
  --scoring sigmoid --shared-experts 1 --hf-init "$work/moe"
# Expert parallel: the measured all-to-all bytes are printed per step; the export is one file per
# ep rank's writer, and loads again at another ep.
step "MoE at (dp, ep) = (4, 2), exported" run 4 "$main" --model moe --data "$tokens" --steps 4 --ep 2 \
  --export-hf "$work/moe_ep"
step "MoE from the ep=2 export at (dp, tp, ep) = (2, 2, 2)" run 4 "$main" --model moe --data "$tokens" --steps 3 \
  --dp 2 --tp 2 --ep 2 --hf-init "$work/moe_ep"
# Context parallel: a context over the activation budget of one rank at cp=1 fits at cp=2.
budget() {
  local log="$work/budget.log"
  if mpi 1 "$main" --data "$tokens" --steps 1 --seq 1024 --batch 1 --microbatches 1 --check-unsharded 0 \
      --activation-budget-mib 20 > "$log" 2>&1; then echo "cp=1 fitted the budget"; return 1; fi
  grep -o "the first step's forward/backward peak.*" "$log" | head -1
  run 2 "$main" --data "$tokens" --steps 3 --seq 1024 --batch 2 --microbatches 2 --cp 2 --activation-budget-mib 20 &&
    grep -E "^(plan|activation budget)" "$work/run.log"
}
step "Llama with 1024-token sequences: over a 20 MiB activation budget at cp=1, within it at cp=2 (matching the unsharded run)" budget
step "Llama at (cp, tp) = (2, 2)" run 4 "$main" --data "$tokens" --steps 3 --cp 2 --tp 2
vocab_refused() {
  local log="$work/vocab.log"
  mkdir -p "$work/small" && cp "$work/hf/model.safetensors" "$work/small/"
  sed 's/"vocab_size": 512/"vocab_size": 100/' "$work/hf/config.json" > "$work/small/config.json"
  if mpi 2 "$main" --data "$tokens" --steps 1 --hf-init "$work/small" > "$log" 2>&1; then echo "accepted"; return 1; fi
  head -2 "$log"
  [ "$(grep -c "has a vocabulary of 512 ids but the model's config has vocab_size 100" "$log")" -eq 2 ]
}
step "a token file of a larger vocabulary than the folder's config is refused on every rank" vocab_refused
finish train_lm_test
