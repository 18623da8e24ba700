"""`harness data prepare`: tokenize local text/JSONL into a memory-mapped token file."""

from __future__ import annotations

DESCRIPTION = """\
Tokenize local .txt or .jsonl files into a memory-mapped token file (.bin, uint16 or uint32)
with its metadata (.bin.json); without --tokenizer the tokens are bytes (vocab 256). Point a
spec at it with workload.data: {kind: file, path: ..., dtype: ...}."""

EXAMPLES = """\
examples:
  harness data prepare corpus.txt --out data.bin
  harness data prepare part1.jsonl part2.jsonl --text-key content --tokenizer tokenizer.json --out data.bin"""


def add_arguments(p):
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser(
        "prepare",
        help="text or JSONL -> .bin token file (+ .bin.json metadata)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=p.formatter_class,
    )
    prep.add_argument("inputs", nargs="+", help=".txt files or .jsonl files with a text field")
    prep.add_argument("--out", required=True, help="output .bin")
    prep.add_argument("--tokenizer", help="local tokenizer.json; without it, byte-level tokens (vocab 256)")
    prep.add_argument("--text-key", default="text", help="JSONL field holding the text")


def main(args) -> int:
    from harness.commands.outputs import check_output_path
    from harness.data.prepare import prepare

    check_output_path(args.out, "--out", directory=False)
    meta = prepare(args.inputs, args.out, args.tokenizer, args.text_key)
    print(
        f"wrote {meta['tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab_size']}, "
        f"tokenizer {meta['tokenizer']}) to {args.out}; set workload.data: "
        f"{{kind: file, path: {args.out}, dtype: {meta['dtype']}}}"
    )
    return 0
