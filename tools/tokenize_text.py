#!/usr/bin/env python3
"""Writes a token file (data/token_file.h) from text files with a Hugging Face tokenizer.

    tokenize_text.py --tokenizer tokenizer.json --output corpus.tokens a.txt b.txt
    tokenize_text.py --train-vocab 512 --tokenizer tokenizer.json --output corpus.tokens corpus.txt
    tokenize_text.py --tokenizer tokenizer.json --separator '\\n\\n\\n' --output x.tokens big.txt

Each input file is one document, or, with --separator, each piece of a file between separators
(empty pieces are skipped). Documents are encoded one by one (`Tokenizer.encode(text,
add_special_tokens=False)`) and concatenated with the end-of-text id BETWEEN them (none before the
first nor after the last): "doc1 <eot> doc2 <eot> doc3". Files are read as UTF-8, in the order
given.

--train-vocab N first trains a byte-level BPE tokenizer (the GPT-2 scheme: the ByteLevel
pre-tokenizer and decoder, every byte in the initial alphabet, so any text encodes) with a
vocabulary of N tokens, the end-of-text token (--eot-token, default "<|endoftext|>") being id 0,
on the same documents, and saves it to --tokenizer; without it --tokenizer is read
(`tokenizers.Tokenizer.from_file`). Training is deterministic: the same text and N give the same
tokenizer.json.

The token file (little-endian; data/token_file.h is the reference):
    bytes 0-7    magic "FSDPTOK" followed by a zero byte
    bytes 8-11   uint32 version (1)
    bytes 12-15  uint32 token width in bytes: 2 (uint16 tokens) or 4 (uint32)
    bytes 16-19  uint32 end-of-text id
    bytes 20-23  uint32 vocabulary size (every token id is below it)
    bytes 24-31  uint64 token count
    bytes 32-    the tokens, count * width bytes
The width is 2 when the vocabulary fits (<= 65536), else 4, unless --token-bytes says.

--print-ids prints the ids written, one per line, to stdout (the C++ reader's test compares them
with what it reads); --check decodes each document back and requires the original text (true of
byte-level BPE).
"""
import argparse
import array
import struct
import sys

import tokenizers

MAGIC = b"FSDPTOK\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ")  # 32 bytes
DEFAULT_EOT = "<|endoftext|>"


def read_documents(paths, separator):
    docs = []
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
        if separator is None:
            docs.append(text)
        else:
            docs.extend(piece for piece in text.split(separator) if piece)
    return docs


def train_tokenizer(docs, vocab_size, eot_token):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `docs`; `eot_token` is id 0."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eot_token],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def encode(tok, docs, eot_id):
    ids = []
    for i, doc in enumerate(docs):
        if i > 0:
            ids.append(eot_id)
        ids.extend(tok.encode(doc, add_special_tokens=False).ids)
    return ids


def token_file_bytes(ids, vocab_size, eot_id, token_bytes):
    if token_bytes not in (2, 4):
        raise SystemExit("tokenize_text: --token-bytes must be 2 or 4, not %d" % token_bytes)
    if vocab_size > (1 << (8 * token_bytes)):
        raise SystemExit("tokenize_text: a vocabulary of %d does not fit in %d-byte tokens" % (vocab_size, token_bytes))
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SystemExit("tokenize_text: token %d is outside the vocabulary (size %d)" % (bad[0], vocab_size))
    header = HEADER.pack(MAGIC, VERSION, token_bytes, eot_id, vocab_size, len(ids))
    code = next(c for c in "HIL" if array.array(c).itemsize == token_bytes)
    tokens = array.array(code, ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    return header + tokens.tobytes()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="text files (UTF-8)")
    parser.add_argument("--tokenizer", required=True,
                        help="tokenizer.json to read, or to write with --train-vocab")
    parser.add_argument("--output", required=True, help="the token file to write")
    parser.add_argument("--train-vocab", type=int, default=0, metavar="N",
                        help="train a byte-level BPE tokenizer of N tokens on the inputs first")
    parser.add_argument("--eot-token", default=DEFAULT_EOT,
                        help="the end-of-text token (default %(default)s)")
    parser.add_argument("--separator", default=None,
                        help="split each file into documents at this string (Python escapes such as \\n "
                             "are decoded); default: one document per file")
    parser.add_argument("--token-bytes", type=int, default=0,
                        help="2 or 4; default: 2 when the vocabulary fits")
    parser.add_argument("--print-ids", action="store_true", help="print the ids written, one per line")
    parser.add_argument("--check", action="store_true", help="decode every document back and compare")
    args = parser.parse_args(argv)

    separator = None
    if args.separator is not None:
        separator = args.separator.encode("latin-1", "backslashreplace").decode("unicode_escape")
        if not separator:
            raise SystemExit("tokenize_text: --separator must not be empty")
    docs = read_documents(args.inputs, separator)
    if not docs:
        raise SystemExit("tokenize_text: the inputs hold no document")

    if args.train_vocab:
        if args.train_vocab < 257:
            raise SystemExit("tokenize_text: --train-vocab must be at least 257 (256 bytes and the end-of-text token)")
        tok = train_tokenizer(docs, args.train_vocab, args.eot_token)
        tok.save(args.tokenizer)
    else:
        tok = tokenizers.Tokenizer.from_file(args.tokenizer)

    eot_id = tok.token_to_id(args.eot_token)
    if eot_id is None:
        raise SystemExit("tokenize_text: %s has no end-of-text token %r (--eot-token)" % (args.tokenizer, args.eot_token))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids = encode(tok, docs, eot_id)
    if args.check:
        for i, doc in enumerate(docs):
            back = tok.decode(tok.encode(doc, add_special_tokens=False).ids, skip_special_tokens=False)
            if back != doc:
                raise SystemExit("tokenize_text: document %d does not decode back to its text" % i)
    token_bytes = args.token_bytes or (2 if vocab_size <= (1 << 16) else 4)
    data = token_file_bytes(ids, vocab_size, eot_id, token_bytes)
    with open(args.output, "wb") as f:
        f.write(data)
    if args.print_ids:
        sys.stdout.write("".join("%d\n" % t for t in ids))
    sys.stderr.write("tokenize_text: %s: %d documents, %d tokens (vocabulary %d, end-of-text %d, %d-byte tokens)\n"
                     % (args.output, len(docs), len(ids), vocab_size, eot_id, token_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
