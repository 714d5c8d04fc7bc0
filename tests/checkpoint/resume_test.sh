#!/usr/bin/env bash
# Resume parity: train 3 steps on 2 ranks and save (fsdp::dcp), then resume on 1, 3 and 4 ranks
# (and with other strategies) and train to step 6: the parameters must equal an uninterrupted run.
# Once in fp32, once with bf16 mixed precision.   usage: resume_test.sh RESUME_MAIN
set -u
main="$1"
source "$(dirname "$0")/steps.sh"

for mp in "" "--mp"; do
  tag=${mp:+ (bf16 mixed precision)}
  ckpt="$work/ckpt${mp//-/_}"
  step "train 3 steps on 2 ranks and save$tag" mpi 2 "$main" train "$ckpt" 3 $mp
  step "resume on 1 rank$tag" mpi 1 "$main" resume "$ckpt" 6 $mp
  step "resume on 3 ranks$tag" mpi 3 "$main" resume "$ckpt" 6 $mp
  step "resume on 4 ranks$tag" mpi 4 "$main" resume "$ckpt" 6 $mp
  step "resume on 2 ranks with SHARD_GRAD_OP$tag" mpi 2 "$main" resume "$ckpt" 6 $mp --strategy grad_op
  step "resume on 3 ranks with NO_SHARD$tag" mpi 3 "$main" resume "$ckpt" 6 $mp --strategy no_shard
  step "control: without the optimizer state the run differs$tag" mpi 2 "$main" resume "$ckpt" 6 $mp --model-only
done
finish resume_test
