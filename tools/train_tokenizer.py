"""Train a sentencepiece or a GPT-2-style byte-level BPE tokenizer on a local corpus.

Inputs are read exactly as tools/preprocess_data.py reads them (jsonl, text files, folders,
parquet/csv/arrow); malformed records are skipped and counted.

    python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 8000 --output out/tok
        -> out/tok/vocab.json, out/tok/merges.txt, out/tok/tokenizer.json
           (use with --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...)
    python tools/train_tokenizer.py --input docs/ --type sentencepiece --vocab-size 1000 --output out/sp
        -> out/sp.model, out/sp.vocab (use with --tokenizer-type SentencePieceTokenizer)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from megazoo.data.text_sources import DEFAULT_TEXT_SUFFIXES, iter_records, parse_record, resolve_inputs  # noqa: E402
from megazoo.data.tokenizers import GPT2_EOD  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files, folders or globs")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--text-suffixes", default=",".join(DEFAULT_TEXT_SUFFIXES))
    p.add_argument("--type", choices=["sentencepiece", "bpe"], required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output", required=True, help="sentencepiece: model prefix; bpe: output folder")
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe", "char", "word"],
                   help="sentencepiece algorithm")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="sentencepiece keeps at most this many (sampled) lines in memory")
    return p.parse_args(argv)


class Corpus:
    """Iterates document texts once per pass; counts what it skipped."""

    def __init__(self, args) -> None:
        suffixes = None if args.text_suffixes == "all" else tuple(args.text_suffixes.split(","))
        self.plan = resolve_inputs(args.input, suffixes)
        self.keys = args.json_keys
        self.docs = self.bad = 0

    def __iter__(self):
        with tqdm(total=self.plan.total_bytes, unit="B", unit_scale=True, desc="reading") as bar:
            for record, done in iter_records(self.plan.files, self.keys):
                texts, _, error = parse_record(record, self.keys)
                bar.update(done)
                if error:
                    self.bad += 1
                    continue
                if texts:
                    self.docs += 1
                    yield from (t for t in texts.values() if t)


def train_sentencepiece(args, corpus: Corpus) -> str:
    import sentencepiece as spm

    def lines():
        for text in corpus:
            yield from (line for line in text.split("\n") if line.strip())

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(), model_prefix=args.output, vocab_size=args.vocab_size,
        model_type=args.model_type, character_coverage=args.character_coverage,
        input_sentence_size=args.max_sentences, shuffle_input_sentence=True,
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    return args.output + ".model"


def train_bpe(args, corpus: Corpus) -> str:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(iter(corpus), vocab_size=args.vocab_size, special_tokens=[GPT2_EOD], show_progress=False)
    os.makedirs(args.output, exist_ok=True)
    tok.save_model(args.output)
    tok.save(os.path.join(args.output, "tokenizer.json"))
    return os.path.join(args.output, "vocab.json")


def main(argv=None) -> int:
    args = get_args(argv)
    corpus = Corpus(args)
    out = train_sentencepiece(args, corpus) if args.type == "sentencepiece" else train_bpe(args, corpus)
    if corpus.docs == 0:
        print(f"error: no documents in {' '.join(args.input)}; check --input and --json-keys", file=sys.stderr)
        return 1
    print(f"trained {args.type} ({args.vocab_size} tokens) on {corpus.docs} documents "
          f"({corpus.bad} malformed skipped): {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
