"""Turn text into a memory-mapped token file: OUT.bin + OUT.idx (+ OUT.tokenizer.json).

Examples:
    # the demo corpus: the Python standard library's own sources, capped at 3 MB of text
    python tools/preprocess_data.py --python-stdlib --max-bytes 3M --output-prefix data/stdlib
    # text files and directories (searched recursively for --glob), JSONL with a "text" field
    python tools/preprocess_data.py --input notes/ book.txt --glob '*.md' --output-prefix data/mine
    python tools/preprocess_data.py --input corpus.jsonl --json-key text --output-prefix data/web \\
        --tokenizer bpe --vocab-size 8192

Prints one summary line (documents, tokens, bytes). Byte-level tokens (vocab 257) by default; BPE is
trained locally on the same corpus with the `tokenizers` package, nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    import megazero  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.data.corpus import cap_bytes, demo_corpus, file_documents, input_files, preprocess  # noqa: E402

_UNITS = {"": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def parse_size(text: str) -> int:
    """'3M' -> 3000000; plain integers are bytes."""
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"--max-bytes {text!r}: use a byte count like 3000000 or 3M")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--max-bytes {text!r} must be positive")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="text files, directories (recursive, see --glob) or .jsonl files")
    src.add_argument("--python-stdlib", action="store_true",
                     help="use this Python's standard library sources (*.py) as the corpus")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json")
    p.add_argument("--glob", default="*.txt", help="file pattern inside input directories (default *.txt)")
    p.add_argument("--json-key", default="text", help="field holding the text in .jsonl lines (default text)")
    p.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size (with --tokenizer bpe)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the end-of-document token (default on)")
    p.add_argument("--max-bytes", type=parse_size,
                   help="stop after the document that brings the text read to this size (e.g. 3M)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def documents():
        if args.python_stdlib:
            return demo_corpus(args.max_bytes)
        return cap_bytes(file_documents(input_files(args.input, args.glob), args.json_key), args.max_bytes)

    try:
        if args.input:
            input_files(args.input, args.glob)  # fail on a bad path before writing anything
        summary = preprocess(documents, args.output_prefix, tokenizer=args.tokenizer,
                             vocab_size=args.vocab_size, append_eod=args.append_eod)
    except (OSError, ValueError, ImportError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
