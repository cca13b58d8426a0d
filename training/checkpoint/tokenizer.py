"""The tokenizer that travels with a checkpoint: `<checkpoint root>/tokenizer/`.

Training (from the tokenizer flags, or from `--load`'s folder when no tokenizer flag is given),
import (the Hugging Face folder's tokenizer files) and fine-tuning all write it, with a record
`megazoo_tokenizer.json`: the tokenizer type to build it with and the model's special-token ids
(`eos_token_id` may be a list; `generation_eos_token_id` is generation_config.json's) and its
`fingerprint` (vocabulary, merges, normalizer, pre-tokenizer: `data.tokenizers`), which a resume
and the datasets' stats are compared with before training starts (`check_run_tokenizer`). So
tools/generate.py and export need no tokenizer flags and use the tokenizer the model was trained
with, and generation stops where `transformers` stops.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

from megazoo.data.blended import blend_prefixes
from megazoo.data.per_split import per_split_prefixes
from megazoo.data.indexed import bin_path, idx_path
from megazoo.data.token_stats import VocabularyMismatch, current_stats, describe_tokenizer
from megazoo.data.tokenizers import (GPT2_TYPES, HF_TYPES, NULL_TYPES, SENTENCEPIECE_TYPES, TokenizerError,
                             build_tokenizer, same_tokenizer)

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
RECORD = "megazoo_tokenizer.json"


def tokenizer_dir(checkpoint: str) -> str:
    """The tokenizer folder of a checkpoint root or of one of its iter_* folders."""
    folder = os.path.normpath(checkpoint)
    root = os.path.dirname(folder) if os.path.basename(folder).startswith("iter_") else folder
    return os.path.join(root, "tokenizer")


def copy_tokenizer(src: str | None, dst: str) -> list[str]:
    """Copy the tokenizer files of folder `src` into `dst`; returns their names."""
    if not src or not os.path.isdir(src):
        return []
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
    if copied:
        os.makedirs(dst, exist_ok=True)
        for f in copied:
            if not _same(os.path.join(src, f), os.path.join(dst, f)):
                shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    return copied


def _same(a: str, b: str) -> bool:
    return os.path.exists(b) and os.path.samefile(a, b)


def read_record(folder: str) -> dict:
    path = os.path.join(folder, RECORD)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_record(folder: str, record: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


def hf_token_record(hf_folder: str, hf_config) -> dict:
    """The special-token ids of an imported Hugging Face model: config.json's, and the
    end-of-sequence ids generation_config.json gives `generate` (an int or a list)."""
    record = {k: getattr(hf_config, k, None) for k in TOKEN_IDS}
    path = os.path.join(hf_folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            record["generation_eos_token_id"] = eos
    return record


def _copy_file(src: str, dst_folder: str, name: str) -> None:
    os.makedirs(dst_folder, exist_ok=True)
    if not _same(src, os.path.join(dst_folder, name)):
        shutil.copy2(src, os.path.join(dst_folder, name))


def store_training_tokenizer(data, checkpoint) -> str | None:
    """Write `<--save>/tokenizer/` for a training run (rank 0, before training): the files the
    tokenizer flags name, else `--load`'s tokenizer folder; the record keeps the loaded model's
    special-token ids. Returns the folder (None when there is nothing to store)."""
    if not checkpoint.save:
        return None
    dst = tokenizer_dir(checkpoint.save)
    loaded = tokenizer_dir(checkpoint.load) if checkpoint.load else None
    record = read_record(loaded) if loaded else {}
    kind = data.tokenizer_type
    if kind in GPT2_TYPES and data.vocab_file and data.merge_file:
        _copy_file(data.vocab_file, dst, "vocab.json")
        _copy_file(data.merge_file, dst, "merges.txt")
    elif kind in SENTENCEPIECE_TYPES and data.tokenizer_model:
        _copy_file(data.tokenizer_model, dst, "tokenizer.model")
    elif kind in HF_TYPES and data.tokenizer_model and os.path.isfile(data.tokenizer_model):
        _copy_file(data.tokenizer_model, dst, "tokenizer.json")
        copy_tokenizer(os.path.dirname(data.tokenizer_model), dst)
    elif kind in HF_TYPES and data.tokenizer_model:
        copy_tokenizer(data.tokenizer_model, dst)
    elif kind in NULL_TYPES:  # no files: ids are text; the vocabulary size is the model's
        pass
    elif loaded and os.path.isdir(loaded):
        copy_tokenizer(loaded, dst)
        kind = record.get("tokenizer_type", "HuggingFaceTokenizer")
    else:
        return None
    if kind not in NULL_TYPES and (_flags_given(data) or not record.get("fingerprint")):
        record["fingerprint"] = _fingerprint_of(checkpoint.save, kind)
    write_record(dst, {**record, "tokenizer_type": kind})
    logger.info("tokenizer (%s) stored in %s", kind, dst)
    return dst


def _flags_given(data) -> bool:
    return bool(data.vocab_file or data.merge_file or data.tokenizer_model)


def saved_fingerprint(checkpoint: str) -> str | None:
    """The fingerprint of a checkpoint's tokenizer: its record's, else computed from its files
    (checkpoints written before the record had one); None when it carries no tokenizer."""
    record = read_record(tokenizer_dir(checkpoint))
    return record.get("fingerprint") or _fingerprint_of(checkpoint, record.get("tokenizer_type"))


def _fingerprint_of(checkpoint: str, kind: str | None) -> str | None:
    """The fingerprint of the tokenizer built from a checkpoint's tokenizer files (None: no
    files, a NullTokenizer, or files that do not build, which is said)."""
    folder = tokenizer_dir(checkpoint)
    if kind in NULL_TYPES or \
            not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES[:-1]):
        return None
    try:
        return checkpoint_tokenizer(checkpoint, kind).fingerprint()
    except TokenizerError as e:
        logger.warning("%s: its tokenizer cannot be built (%s); no fingerprint to compare", folder, e)
        return None


def data_prefixes(data) -> list[str]:
    """The dataset prefixes of the run's data (a DataConfig): --data-path (weighted or not), or
    every prefix of --train/valid/test-data-path."""
    if data.per_split is not None:
        return per_split_prefixes(data.per_split)
    return blend_prefixes(data.data_path)


def check_run_tokenizer(tok, data, checkpoint) -> None:
    """Refuse, before any process group, a run whose tokenizer is not the one its --load
    checkpoint (with --finetune: said in one line) or its datasets were made with, even with a
    vocabulary of the same size: both fingerprints are named."""
    mine = tok.fingerprint()
    if checkpoint.load:
        theirs = saved_fingerprint(checkpoint.load)
        if theirs is not None and _differs(theirs, mine, f"--load {checkpoint.load}"):
            msg = (f"--load {checkpoint.load} was trained with another tokenizer (fingerprint "
                   f"{theirs}, files in {tokenizer_dir(checkpoint.load)}) than this run's "
                   f"--tokenizer-type {data.tokenizer_type} (fingerprint {mine})")
            if not checkpoint.finetune:
                raise TokenizerError(f"{msg}; pass the checkpoint's tokenizer (e.g. --tokenizer-model "
                                     f"{tokenizer_dir(checkpoint.load)}), or --finetune to start anew")
            logger.warning("%s; --finetune: training on with this run's tokenizer", msg)
    for prefix in ([] if data.mock_data else data_prefixes(data)):
        if not (os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))):
            continue  # a missing file is named where the dataset is opened
        made = (current_stats(prefix) or {}).get("tokenizer") or {}
        if made.get("fingerprint") and _differs(made["fingerprint"], mine, prefix):
            raise VocabularyMismatch(
                f"{prefix}: made with {describe_tokenizer(made)}, fingerprint {made['fingerprint']}; "
                f"this run's tokenizer ({data.tokenizer_type}) has fingerprint {mine}: train with the "
                f"data's tokenizer, or preprocess the corpus again with this one")


def _differs(theirs: str, mine: str, what: str) -> bool:
    same = same_tokenizer(theirs, mine)
    if same is None:
        logger.warning("%s was made with a tokenizer of another library (%s, this run %s); the ids "
                       "may agree but cannot be compared: check them", what, theirs, mine)
    return same is False


def checkpoint_tokenizer(checkpoint: str, tokenizer_type: str | None = None, *,
                         vocab_file: str | None = None, merge_file: str | None = None,
                         tokenizer_model: str | None = None):
    """The tokenizer of a checkpoint: explicit flags win; else the checkpoint's tokenizer folder,
    built with the type it was trained (or imported) with."""
    folder = tokenizer_dir(checkpoint)
    kind = tokenizer_type or read_record(folder).get("tokenizer_type") or "HuggingFaceTokenizer"
    if vocab_file or merge_file or tokenizer_model:
        return build_tokenizer(kind, vocab_file=vocab_file, merge_file=merge_file,
                               tokenizer_model=tokenizer_model)
    if kind in NULL_TYPES:  # its end-of-document id is the last of the model's vocabulary
        from megazoo.training.checkpoint.format import read_meta
        return build_tokenizer(kind, vocab_size=read_meta(checkpoint)["model"]["vocab_size"] - 1)
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES[:-1]):
        raise TokenizerError(f"{folder}: not found, the checkpoint carries no tokenizer; pass "
                             f"--tokenizer-model (or --vocab-file and --merge-file)")
    if kind in GPT2_TYPES:
        return build_tokenizer(kind, vocab_file=os.path.join(folder, "vocab.json"),
                               merge_file=os.path.join(folder, "merges.txt"))
    if kind in SENTENCEPIECE_TYPES:
        return build_tokenizer(kind, tokenizer_model=os.path.join(folder, "tokenizer.model"))
    return build_tokenizer(kind, tokenizer_model=folder)


def eos_token_ids(checkpoint: str, meta: dict) -> list[int] | None:
    """Where `transformers` stops generating: generation_config.json's eos ids, else
    config.json's (recorded at import, carried through fine-tuning); None when unknown."""
    record = {**(meta.get("hf_config") or {}), **read_record(tokenizer_dir(checkpoint))}
    eos = record.get("generation_eos_token_id", record.get("eos_token_id"))
    if eos is None:
        return None
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
