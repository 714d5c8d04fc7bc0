#!/usr/bin/env bash
# End to end in Python: PyTorch's FSDP2 writes a Hugging Face-layout distributed checkpoint on 2
# ranks; dcp_read_checkpoint.py reads it back with torch.distributed.checkpoint and by hand and
# compares it bit for bit with the full values; then altered copies show the check fails when it must.
#   fsdp2_dcp_interop_test.sh PYTHON WRITE_SCRIPT READ_SCRIPT VARIANTS_SCRIPT
set -euo pipefail
py="$1"; write="$2"; read_ckpt="$3"; variants="$4"
work="${TEST_TMPDIR:-$(mktemp -d)}/interop"
rm -rf "$work"; mkdir -p "$work"
export OMP_NUM_THREADS=1
fail() { echo "FAILED: $*" >&2; exit 1; }

expect_fail() {  # expect_fail WORD_IN_STDERR command...
  local word="$1"; shift
  local rc=0
  "$@" > "$work/out.txt" 2> "$work/err.txt" || rc=$?
  cat "$work/out.txt" "$work/err.txt"
  [ "$rc" -eq 1 ] || fail "expected exit 1, got $rc: $*"
  grep -q -- "$word" "$work/err.txt" || fail "the message does not name $word: $*"
}

start=$(date +%s)
"$py" "$write" "$work/w2" --world-size 2 --steps 2
echo "--- write: $(( $(date +%s) - start )) s"
ckpt="$work/w2/ckpt"
ref="$work/w2/reference.safetensors"
for r in 1 2; do
  f="$ckpt/shard-0000${r}-model-00001-of-00001.safetensors"
  [ -f "$f" ] || fail "missing $f"
done
[ "$(ls "$ckpt" | wc -l)" -eq 2 ] || fail "expected exactly 2 files in $ckpt: $(ls "$ckpt")"

"$py" "$read_ckpt" "$ckpt" "$ref" | tee "$work/read.txt"
# The boxes FSDP2 writes: Shard(0), uneven where 2 does not divide the rows.
grep -q "w2.weight \[7, 24\] torch.float32: 2 boxes (offsets, shape) \[(\[0, 0\], \[4, 24\]), (\[4, 0\], \[3, 24\])\]" "$work/read.txt" ||
  fail "unexpected boxes of w2.weight"
grep -q "emb.weight \[10, 13\] torch.float32: 2 boxes (offsets, shape) \[(\[0, 0\], \[5, 13\]), (\[5, 0\], \[5, 13\])\]" "$work/read.txt" ||
  fail "unexpected boxes of emb.weight"

# Entries beside the model (optimizer state, user entries, a manifest) are listed, not compared.
"$py" "$variants" ckpt-extras "$ckpt" "$work/extras"
"$py" "$read_ckpt" "$work/extras" "$ref" | tee "$work/extras.txt"
grep -q "not compared (state, 1): \['state.w1.weight.exp_avg'\]" "$work/extras.txt" || fail "state entries not reported"
grep -q "not compared (extra, 1): \['extra.step'\]" "$work/extras.txt" || fail "extra entries not reported"
grep -q "not compared (param_groups, 1)" "$work/extras.txt" || fail "param_groups entries not reported"
grep -q "other files (not read): \['fsdp_checkpoint.json'\]" "$work/extras.txt" || fail "manifest not reported"

# A value one float away, a key the checkpoint lacks, a box missing.
"$py" "$variants" ref-perturb "$ref" "$work/ref_perturbed.safetensors" w2.weight
expect_fail "w2.weight" "$py" "$read_ckpt" "$ckpt" "$work/ref_perturbed.safetensors"
"$py" "$variants" ref-add-key "$ref" "$work/ref_more.safetensors" head.weight
expect_fail "lacks 1 reference keys: \['head.weight'\]" "$py" "$read_ckpt" "$ckpt" "$work/ref_more.safetensors"
"$py" "$variants" ckpt-drop-box "$ckpt" "$work/dropped" norm.bias
expect_fail "norm.bias" "$py" "$read_ckpt" "$work/dropped" "$ref"
# The untrained model's values are not the checkpoint's.
"$py" "$variants" reference "$work/init.safetensors"
expect_fail "FAIL: emb.weight" "$py" "$read_ckpt" "$ckpt" "$work/init.safetensors"
echo "PASSED in $(( $(date +%s) - start )) s"
