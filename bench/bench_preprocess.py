"""Preprocessing speed, side by side: tools/preprocess_data.py, a plain ``datasets.map`` and
Megatron-LM's own tools/preprocess_data.py; and the chat path, tools/preprocess_sft.py, against a
``datasets.map`` of ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (TRL's way).

Corpus (one jsonl, read by all three): the Python standard library's UTF-8 *.py files, one
document per file, plus real prose where it is on the machine offline (the Rust toolchain's
books, ``share/doc/rust/html/*/print.html``, tags stripped, one document per chapter). The chat
corpus is built from the same text: conversations of alternating user / assistant turns cut from
consecutive paragraphs of each document.
Tokenizer: GPT-2 BPE from tests/fixtures/gpt2. datasets.map calls the Rust fast tokenizer
(`tokenizers.Tokenizer.encode_batch_fast`); ours is that same tokenizer behind a per-word id cache
(data/gpt2_words.py, the same ids); Megatron's tool builds its own GPT2BPETokenizer from the same
files (its pure-Python BPE caches words too).

Each configuration runs as its own process tree (wall time includes start-up); peak memory is
the largest RSS summed over the tree, sampled every 20 ms; CPU s is user + system over the tree.
Methods are interleaved within each round and each configuration keeps its median round, so a
burst of load from other jobs does not land on one method only. The outputs are checked: ours and
Megatron's .bin/.idx must be byte-identical; datasets.map's token count is reported beside ours.

Megatron-LM is not part of this repository: pass a checkout with ``--megatron-lm PATH`` (its
tools/preprocess_data.py runs as a subprocess with PATH first on PYTHONPATH); without it that
column is skipped with a message. Tag core_v0.14.0 runs on a CPU-only machine (later tags import
triton from megatron.training, or build the GPT-2 tokenizer from the Hugging Face hub).

    git -C Megatron-LM worktree add /tmp/megatron-lm core_v0.14.0
    nice -n 5 python bench/bench_preprocess.py --megatron-lm /tmp/megatron-lm [--workers 1 2]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import sysconfig
import tempfile
from html.parser import HTMLParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from preprocess_measure import plot, profile_stages, run_measured  # noqa: E402

GPT2 = os.path.join(ROOT, "tests", "fixtures", "gpt2")
VOCAB, MERGES = os.path.join(GPT2, "vocab.json"), os.path.join(GPT2, "merges.txt")
PROSE_GLOB = os.path.expanduser("~/.rustup/toolchains/*/share/doc/rust/html/*/print.html")
# ChatML with the replies marked as generation (what return_assistant_tokens_mask needs).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}"
          "{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = ("preprocess_data.py", "datasets.map", "megatron preprocess_data.py")
CHAT = ("preprocess_sft.py", "datasets.map chat")


# ---------------------------------------------------------------- corpus
class _Text(HTMLParser):
    """The visible text of an HTML page, split at <h1> (a chapter of an mdBook print page)."""

    def __init__(self):
        super().__init__()
        self.chapters, self._skip = [[]], 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "nav"):
            self._skip += 1
        elif tag == "h1":
            self.chapters.append([])

    def handle_endtag(self, tag):
        if tag in ("script", "style", "nav"):
            self._skip = max(0, self._skip - 1)

    def handle_data(self, data):
        if not self._skip:
            self.chapters[-1].append(data)


def prose_documents() -> tuple[list[str], list[str]]:
    """(source files, chapters) of the Rust books found offline; empty when there are none."""
    books = {}  # one copy of each book (stable and nightly toolchains ship the same ones)
    for path in sorted(glob.glob(PROSE_GLOB), key=lambda p: ("nightly" in p, p)):
        books.setdefault(os.path.basename(os.path.dirname(path)), path)
    files, docs = sorted(books.values()), []
    for path in files:
        parser = _Text()
        with open(path, encoding="utf-8") as f:
            parser.feed(f.read())
        for chapter in parser.chapters:
            text = re.sub(r"\n{3,}", "\n\n", "".join(chapter)).strip()
            if len(text) > 200:
                docs.append(text)
    return files, docs


def python_documents() -> list[str]:
    from megazoo.data.text_sources import resolve_inputs

    docs = []
    for _, path in resolve_inputs([sysconfig.get_path("stdlib")], (".py",)).files:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the tools skip these too; left out so all methods see the same documents
        if text.strip():
            docs.append(text)
    return docs


def conversations(docs: list[str], max_mb: float) -> list[dict]:
    """Chats cut from the documents: paragraphs of ~600 characters, alternating user / assistant."""
    out, size = [], 0
    for doc in docs:
        turns, cur = [], ""
        for para in doc.split("\n\n"):
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= 600:
                turns.append(cur)
                cur = ""
        for i in range(0, len(turns) - 1, 4):
            chunk = turns[i:i + 4]
            msgs = [{"role": "system", "content": "Answer from the text."}] + [
                {"role": ("user", "assistant")[j % 2], "content": t} for j, t in enumerate(chunk)]
            if msgs[-1]["role"] == "user":
                msgs.pop()
            out.append({"messages": msgs})
            size += sum(len(t) for t in chunk)
            if size > max_mb * 1e6:
                return out
    return out


def chat_tokenizer_folder(path: str) -> str:
    from transformers import GPT2TokenizerFast

    tok = GPT2TokenizerFast(VOCAB, MERGES)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path


# ---------------------------------------------------------------- the baselines (run as subprocesses)
def baseline_plain(jsonl: str, num_proc: int, cache_dir: str) -> None:
    """The plain approach: load the jsonl with datasets, tokenize with .map, save to disk."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from datasets import load_dataset

    from megazoo.data.tokenizers import build_tokenizer

    os.makedirs(cache_dir, exist_ok=True)
    cache_dir = tempfile.mkdtemp(dir=cache_dir)  # fresh per run: a warm datasets cache would skip the work
    ours = build_tokenizer("GPT2BPETokenizer", VOCAB, MERGES)
    # the fast tokenizer itself (the Rust `tokenizers.Tokenizer` ours wraps), at its fastest call:
    # the plain approach has no word cache
    rust, eod = ours._tok, ours.eod
    ds = load_dataset("json", data_files=jsonl, split="train", cache_dir=cache_dir)

    def encode(batch):
        ids = [e.ids for e in rust.encode_batch_fast(batch["text"], add_special_tokens=False)]
        for doc in ids:
            doc.append(eod)
        return {"input_ids": ids}

    out = ds.map(encode, batched=True, num_proc=num_proc if num_proc > 1 else None, remove_columns=["text"])
    out.save_to_disk(os.path.join(cache_dir, "tokenized"))
    print(json.dumps({"docs": len(out), "tokens": sum(len(x) for x in out["input_ids"])}))


def baseline_chat(jsonl: str, num_proc: int, cache_dir: str, folder: str) -> None:
    """TRL's way: one apply_chat_template per conversation in a datasets.map, save to disk."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from datasets import load_dataset
    from transformers import AutoTokenizer

    os.makedirs(cache_dir, exist_ok=True)
    cache_dir = tempfile.mkdtemp(dir=cache_dir)
    tok = AutoTokenizer.from_pretrained(folder)
    ds = load_dataset("json", data_files=jsonl, split="train", cache_dir=cache_dir)

    def encode(example):
        out = tok.apply_chat_template(example["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    out = ds.map(encode, num_proc=num_proc if num_proc > 1 else None, remove_columns=["messages"])
    out.save_to_disk(os.path.join(cache_dir, "tokenized"))
    print(json.dumps({"docs": len(out), "tokens": sum(len(x) for x in out["input_ids"]),
                      "assistant_tokens": sum(sum(x) for x in out["assistant_masks"])}))


# ---------------------------------------------------------------- the driver
def command(method: str, w: int, tmp: str, args) -> tuple[list[str], dict | None]:
    """The command line of one configuration, and the environment it needs (None: inherited)."""
    me = [sys.executable, os.path.abspath(__file__)]
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES, "--append-eod"]
    plain, chat = os.path.join(tmp, "corpus.jsonl"), os.path.join(tmp, "chat.jsonl")
    if method == "preprocess_data.py":
        return [sys.executable, "tools/preprocess_data.py", "--input", plain, "--output-prefix",
                os.path.join(tmp, f"ours{w}"), *tok, "--workers", str(w), "--no-progress"], None
    if method == "megatron preprocess_data.py":
        env = dict(os.environ, PYTHONPATH=args.megatron_lm)
        return [sys.executable, os.path.join(args.megatron_lm, "tools", "preprocess_data.py"), "--input", plain,
                "--output-prefix", os.path.join(tmp, f"megatron{w}"), *tok, "--workers", str(w)], env
    if method == "datasets.map":
        return me + ["--baseline", "plain", plain, str(w), os.path.join(tmp, "hf")], None
    if method == "preprocess_sft.py":
        return [sys.executable, "tools/preprocess_sft.py", "--input", chat, "--output-prefix",
                os.path.join(tmp, f"sft{w}"), "--tokenizer-model", os.path.join(tmp, "chat_tok"),
                "--workers", str(w)], None
    return me + ["--baseline", "chat", chat, str(w), os.path.join(tmp, "hf"), os.path.join(tmp, "chat_tok")], None


def outcome(method: str, w: int, tmp: str, out: str) -> dict:
    """Documents and tokens a run wrote (and, for Megatron's, whether its files equal ours)."""
    import numpy as np

    from megazoo.data.indexed import IndexedDataset

    if method.startswith("datasets.map"):
        return json.loads(out.strip().splitlines()[-1])
    prefix = {"preprocess_data.py": f"ours{w}", "megatron preprocess_data.py": f"megatron{w}",
              "preprocess_sft.py": f"sft{w}"}[method] + "_text_document"
    ds = IndexedDataset(os.path.join(tmp, prefix))
    info = {"docs": ds.num_documents, "tokens": int(ds.sequence_lengths.sum())}
    ds.close()
    if method == "preprocess_sft.py":
        masks = IndexedDataset(os.path.join(tmp, f"sft{w}_assistant_mask_document"))
        info["assistant_tokens"] = int(masks.all_tokens().sum(dtype=np.int64))
        masks.close()
    if method == "megatron preprocess_data.py":
        ours = os.path.join(tmp, f"ours{w}_text_document")
        info["identical_to_ours"] = all(
            os.path.exists(ours + ext) and open(ours + ext, "rb").read() == open(os.path.join(tmp, prefix) + ext, "rb").read()
            for ext in (".bin", ".idx"))
    return info


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median of each is kept")
    p.add_argument("--megatron-lm", help="a Megatron-LM checkout (its tools/preprocess_data.py is run)")
    p.add_argument("--no-prose", action="store_true", help="the .py corpus only")
    p.add_argument("--chat-mb", type=float, default=4.0, help="characters of chat corpus, in millions (0: no chat runs)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "data_preprocess.json"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    p.add_argument("--baseline", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plot_only:
        with open(args.out) as f:
            return plot(json.load(f), args.out.removesuffix(".json") + ".png")
    if args.baseline:
        kind, jsonl, w, cache, *rest = args.baseline
        return (baseline_plain if kind == "plain" else baseline_chat)(jsonl, int(w), cache, *rest)
    methods = list(PLAIN)
    if not args.megatron_lm or not os.path.isfile(os.path.join(args.megatron_lm, "tools", "preprocess_data.py")):
        print(f"Megatron-LM column skipped: --megatron-lm {args.megatron_lm!r} is not a checkout with "
              f"tools/preprocess_data.py (see this script's docstring for how to get one)")
        methods.remove("megatron preprocess_data.py")
    if args.chat_mb > 0:
        methods += CHAT

    with tempfile.TemporaryDirectory() as tmp:
        py_docs = python_documents()
        prose_files, prose = ([], []) if args.no_prose else prose_documents()
        docs = py_docs + prose
        with open(os.path.join(tmp, "corpus.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        chats = conversations(docs, args.chat_mb)
        with open(os.path.join(tmp, "chat.jsonl"), "w") as f:
            f.writelines(json.dumps(c) + "\n" for c in chats)
        mb = os.path.getsize(os.path.join(tmp, "corpus.jsonl")) / 1e6
        chat_mb = os.path.getsize(os.path.join(tmp, "chat.jsonl")) / 1e6
        chat_tokenizer_folder(os.path.join(tmp, "chat_tok"))
        corpus = {"python_files": len(py_docs), "stdlib": sysconfig.get_path("stdlib"),
                  "prose_chapters": len(prose), "prose_files": prose_files, "documents": len(docs),
                  "jsonl_mb": round(mb, 2), "chat_conversations": len(chats), "chat_jsonl_mb": round(chat_mb, 2)}
        print(f"corpus: {corpus}")
        rounds: dict[tuple[str, int], list[dict]] = {}
        for rnd in range(args.repeat):
            for w in args.workers:
                for method in methods:
                    cmd, env = command(method, w, tmp, args)
                    wall, peak, out, cpu = run_measured(cmd, ROOT, env)
                    size = chat_mb if method in CHAT else mb
                    run = {"method": method, "workers": w, "wall_s": round(wall, 2), "mb_per_s": round(size / wall, 2),
                           "peak_rss_mb": round(peak), "cpu_s": round(cpu, 2),
                           "load_average_1min": round(os.getloadavg()[0], 2), **outcome(method, w, tmp, out)}
                    print(f"round {rnd}: {run}", flush=True)
                    rounds.setdefault((method, w), []).append(run)
        profile = profile_stages(os.path.join(tmp, "corpus.jsonl"), VOCAB, MERGES, tmp)
        print(f"CPU seconds per stage (one process): {profile}")
    results = {"corpus": corpus, "rounds": args.repeat, "cpu_count": os.cpu_count(), "runs": [], "ratios": {},
               "profile_cpu_s": profile}
    for (method, w), runs in rounds.items():
        median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
        results["runs"].append({**median, "wall_s_rounds": [r["wall_s"] for r in runs]})
    by = {(r["method"], r["workers"]): r for r in results["runs"]}
    for w in args.workers:
        for ours, other in [("preprocess_data.py", m) for m in PLAIN[1:]] + [CHAT]:
            if (ours, w) in by and (other, w) in by:
                results["ratios"][f"{ours} vs {other}, {w} worker(s)"] = {
                    "median_wall": round(by[(other, w)]["wall_s"] / by[(ours, w)]["wall_s"], 2),
                    "per_round": [round(b["wall_s"] / a["wall_s"], 2) for a, b in zip(rounds[(ours, w)], rounds[(other, w)])]}
    results["load_average_1_5_15"] = [round(x, 2) for x in os.getloadavg()]  # other jobs share the cores
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.removesuffix(".json") + ".png")
    print(f"\n{'method':28s} {'workers':>7s} {'wall s':>7s} {'MB/s':>6s} {'peak RSS MB':>11s} {'CPU s':>6s}")
    for r in results["runs"]:
        print(f"{r['method']:28s} {r['workers']:7d} {r['wall_s']:7.2f} {r['mb_per_s']:6.2f} {r['peak_rss_mb']:11d} {r['cpu_s']:6.1f}")
    for name, ratio in results["ratios"].items():
        print(f"{name}: {ratio['median_wall']}x (rounds {ratio['per_round']})")


if __name__ == "__main__":
    main()
