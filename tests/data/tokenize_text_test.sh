#!/usr/bin/env bash
# tools/tokenize_text.py and the C++ reader agree, and the shipped files are reproducible:
#   - retraining the byte-level BPE tokenizer (vocabulary 512) on examples/data/corpus.txt gives the
#     shipped examples/data/tokenizer.json, byte for byte, and its token file the shipped
#     examples/data/corpus.tokens;
#   - tokenizing corpus.txt with the shipped tokenizer gives corpus.tokens again;
#   - the C++ reader (token_file_dump: data/token_file.h, every token checked against the
#     vocabulary) reads exactly the ids the tokenizer produced, with the header's vocabulary and
#     end-of-text id; so it does for documents split with --separator (one end-of-text id between
#     consecutive documents), for several input files, and for 4-byte tokens.
# usage: tokenize_text_test.sh PYTHON TOKENIZE_TEXT_PY TOKENIZER_JSON CORPUS_TXT CORPUS_TOKENS DUMP
set -eu
python="$1"; tool="$2"; shipped_tokenizer="$3"; corpus="$4"; shipped_tokens="$5"; dump="$6"
work="${TEST_TMPDIR:-$(mktemp -d)}/tokenize_text_test"
rm -rf "$work"; mkdir -p "$work"

fail() { echo "FAIL: $*" >&2; exit 1; }
step() { echo "--- $*"; }

# The ids the C++ reader reads, without the header line.
cpp_ids() { "$dump" "$1" | tail -n +2; }

step "retraining the tokenizer reproduces the shipped tokenizer.json and corpus.tokens"
"$python" "$tool" --train-vocab 512 --tokenizer "$work/tokenizer.json" --output "$work/trained.tokens" --check "$corpus"
cmp "$work/tokenizer.json" "$shipped_tokenizer" || fail "the retrained tokenizer differs from $shipped_tokenizer"
cmp "$work/trained.tokens" "$shipped_tokens" || fail "the retrained token file differs from $shipped_tokens"

step "the shipped tokenizer reproduces the shipped corpus.tokens"
"$python" "$tool" --tokenizer "$shipped_tokenizer" --output "$work/corpus.tokens" --print-ids --check "$corpus" \
  > "$work/python_ids.txt"
cmp "$work/corpus.tokens" "$shipped_tokens" || fail "tokenizing $corpus again differs from $shipped_tokens"
[ "$(wc -l < "$work/python_ids.txt")" -gt 1000 ] || fail "too few tokens: $(wc -l < "$work/python_ids.txt")"

step "the C++ reader reads the ids the tokenizer produced"
header=$("$dump" "$shipped_tokens" | head -1)
[ "$header" = "tokens=$(wc -l < "$work/python_ids.txt") vocab=512 eot=0 width=2" ] || fail "header: $header"
cpp_ids "$shipped_tokens" > "$work/cpp_ids.txt"
cmp "$work/cpp_ids.txt" "$work/python_ids.txt" || fail "the C++ reader's ids differ from the tokenizer's"

step "documents split with --separator: one end-of-text id between consecutive documents"
"$python" "$tool" --tokenizer "$shipped_tokenizer" --separator '\n\n' --output "$work/paragraphs.tokens" \
  --print-ids --check "$corpus" > "$work/paragraph_ids.txt"
docs=$("$python" -c 'import sys; print(sum(1 for p in open(sys.argv[1], encoding="utf-8", newline="").read().split("\n\n") if p))' "$corpus")
eots=$(grep -cx 0 "$work/paragraph_ids.txt" || true)
[ "$docs" -gt 5 ] || fail "expected several paragraphs, found $docs"
[ "$eots" -eq $((docs - 1)) ] || fail "expected $((docs - 1)) end-of-text ids between $docs documents, found $eots"
[ "$(head -1 "$work/paragraph_ids.txt")" != 0 ] && [ "$(tail -1 "$work/paragraph_ids.txt")" != 0 ] \
  || fail "an end-of-text id before the first or after the last document"
cpp_ids "$work/paragraphs.tokens" | cmp - "$work/paragraph_ids.txt" || fail "the C++ reader differs (--separator)"

step "several files: the documents in order, an end-of-text id between them"
"$python" "$tool" --tokenizer "$shipped_tokenizer" --output "$work/twice.tokens" --print-ids "$corpus" "$corpus" \
  > "$work/twice_ids.txt"
{ cat "$work/python_ids.txt"; echo 0; cat "$work/python_ids.txt"; } | cmp - "$work/twice_ids.txt" \
  || fail "two files are not doc, eot, doc"
cpp_ids "$work/twice.tokens" | cmp - "$work/twice_ids.txt" || fail "the C++ reader differs (two files)"

step "4-byte tokens"
"$python" "$tool" --tokenizer "$shipped_tokenizer" --token-bytes 4 --output "$work/wide.tokens" "$corpus"
[ "$("$dump" "$work/wide.tokens" | head -1)" = "tokens=$(wc -l < "$work/python_ids.txt") vocab=512 eot=0 width=4" ] \
  || fail "header of the 4-byte file"
cpp_ids "$work/wide.tokens" | cmp - "$work/python_ids.txt" || fail "the C++ reader differs (4-byte tokens)"

echo "tokenize_text_test: passed"
