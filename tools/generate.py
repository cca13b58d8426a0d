"""Generate text from a megazoo checkpoint of any layout, with tensor parallelism and a KV cache.

    python tools/generate.py --load ckpt/gpt2 --prompt "Hello" --max-new-tokens 32
    torchrun --nproc_per_node 2 tools/generate.py --load ckpt/gpt2 --prompt "Hello" \\
        --top-k 50 --top-p 0.9 --temperature 0.8 --seed 1
    python tools/generate.py --load ckpt/qwen --chat --prompt "What is 2 + 2?"

Every process is one tensor-parallel rank (tp = the world size). The tokenizer is the one the
checkpoint carries (`tokenizer/`, written by training, import and fine-tuning, built with the type
it was trained with) unless tokenizer flags are given. Generation stops at the model's eos ids
(generation_config.json's, else config.json's, recorded at import), else the tokenizer's
end-of-document token. `--chat` applies the tokenizer's chat template to each prompt (one user
turn) and prints only the reply. Greedy decoding is the default; any of --temperature/--top-k/
--top-p samples.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from megazoo.data.tokenizers import TokenizerError
from megazoo.models.generation import SamplingConfig, generate
from megazoo.parallel import collectives as C
from megazoo.parallel.topology import LayoutError, ParallelConfig, initialize
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.tokenizer import checkpoint_tokenizer, eos_token_ids
from megazoo.training.checkpoint.hf import load_model_chunks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root (with 'latest') or iter_* folder")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-eos-stop", action="store_true", help="keep going past end-of-text")
    p.add_argument("--chat", action="store_true",
                   help="apply the tokenizer's chat template (one user turn per prompt)")
    p.add_argument("--tokenizer-type", help="default: the type the checkpoint was trained with")
    p.add_argument("--tokenizer-model", help="default: the checkpoint's tokenizer/ folder")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    return p


def chat_prompt(tok, text: str) -> list[int]:
    """`text` as one user turn through the tokenizer's chat template, ready for the reply."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise TokenizerError("--chat: the tokenizer has no chat template (tokenizer_config.json "
                             "chat_template or chat_template.jinja); drop --chat")
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template([[{"role": "user", "content": text}]], chat_template=template,
                                        add_generation_prompt=True, **tok.special_tokens())
    return tok.encode(rendered[0])


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    ok, owned = False, not dist.is_initialized()  # a caller's process group is the caller's
    try:
        rc = _run(args)
        ok = rc == 0
        return rc
    finally:
        if owned:
            _leave(together=ok)


def _leave(together: bool) -> None:
    """End the process group in order: after a run every rank finished, all ranks meet first (a
    gloo rank torn down while a peer still talks to it aborts at exit); output is flushed before."""
    sys.stdout.flush()
    if not dist.is_initialized():
        return
    if together:
        C.barrier(C.world())
    dist.destroy_process_group()


def _run(args) -> int:
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        folder = ckpt.resolve(args.load)
        tok = checkpoint_tokenizer(folder, args.tokenizer_type, vocab_file=args.vocab_file,
                                   merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
        encoded = [chat_prompt(tok, p) if args.chat else tok.encode(p) for p in args.prompt]
        if not all(encoded):
            raise ValueError("a --prompt encodes to no tokens")
        eos = eos_token_ids(folder, ckpt.read_meta(folder)) or [tok.eod]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        topo = initialize(ParallelConfig(tp=world))
        _, (model,) = load_model_chunks(folder, topo)
    except (ckpt.CheckpointError, TokenizerError, LayoutError, ValueError) as e:
        if rank0:  # one voice
            print(f"error: {e}", file=sys.stderr)
        return 1
    sampling = SamplingConfig(
        greedy=args.temperature is None and args.top_k == 0 and args.top_p == 1.0,
        temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p,
        eos_id=None if args.no_eos_stop else tuple(eos))
    generator = torch.Generator().manual_seed(args.seed)
    # The KV cache has no padding mask, so prompts of one length form one batch; the outputs
    # are printed in the order the prompts were given.
    by_length: dict[int, list[int]] = {}
    for i, e in enumerate(encoded):
        by_length.setdefault(len(e), []).append(i)
    outputs: dict[int, list[int]] = {}
    for indices in by_length.values():
        prompt = torch.tensor([encoded[i] for i in indices], dtype=torch.long, device=topo.device)
        out = generate(model, topo, prompt, args.max_new_tokens, sampling, generator)
        outputs.update(zip(indices, out.tolist()))
    if topo.rank == 0:
        for i in range(len(encoded)):
            ids = outputs[i][len(encoded[i]):] if args.chat else outputs[i]
            if args.chat and sampling.eos_ids:  # the reply, without its end-of-turn token
                ids = ids[:next((j for j, t in enumerate(ids) if t in sampling.eos_ids), len(ids))]
            print(tok.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
