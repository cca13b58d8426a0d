"""megazoo as an lm-evaluation-harness model (`lm_eval --model megazoo`): log-likelihoods,
rolling log-likelihoods and greedy generation on a megazoo model of any tensor/pipeline layout.

Two ways in: `MegazooLM(load=CKPT, tp=.., pp=..)` loads a checkpoint (lm_eval's
`--model_args`; every process of a torchrun world builds one, the layout's product being the
world size or a divisor of it, the rest data-parallel copies), or `MegazooLM.of_chunks(...)`
wraps the chunks a training run holds. The tokenizer is the checkpoint's own
(training/checkpoint/tokenizer.py), its chat template serves `--apply_chat_template`.

Every process runs the whole harness on every request (lm_eval sees rank 0 of a world of 1:
its own data-parallel split would hand different requests to the ranks of one model), so the
collectives of the forward passes line up; lm_eval returns the results where LOCAL_RANK is 0.
Requests are scored in batches of `batch_size`, longest first, as lm_eval's HF backend does,
and context and continuation are encoded as it encodes them (TemplateLM), so per-item
log-likelihoods are comparable with `--model hf` on the exported model.
"""
from __future__ import annotations

import logging

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megazoo.training.evaluation.scorer import Scorer

logger = logging.getLogger(__name__)

NAME = "megazoo"


def register() -> None:
    """Make `megazoo` a model name lm_eval knows (idempotent)."""
    if NAME not in model_registry.keys():
        register_model(NAME)(MegazooLM)


def bos_token(tok) -> tuple[str | None, int | None]:
    """(text, id) of the tokenizer's bos_token (tokenizer_config.json), or (None, None)."""
    special = tok.special_tokens() if hasattr(tok, "special_tokens") else {}
    text = special.get("bos_token")
    ids = tok.encode(text) if text else []
    return (text, ids[0]) if len(ids) == 1 else (None, None)


class MegazooLM(TemplateLM):
    def __init__(self, load: str | None = None, tp: int = 1, pp: int = 1, sequence_parallel=False,
                 batch_size=8, max_gen_toks: int = 256, add_bos_token=False, max_batch_size=None,
                 device=None, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"--model_args: unknown megazoo argument(s) {sorted(unknown)}; known: "
                             "load, tp, pp, sequence_parallel, max_gen_toks, add_bos_token")
        if not load:
            raise ValueError("--model_args needs load=CHECKPOINT (a megazoo checkpoint folder)")
        if str(batch_size).startswith("auto"):
            raise ValueError("--batch_size auto is not supported by the megazoo model; give a number")
        if device is not None or max_batch_size is not None:
            logger.info("megazoo model: --device/--max_batch_size not used (the layout picks the "
                        "device: CUDA when present; the batch is --batch_size)")
        from megazoo.parallel.topology import ParallelConfig, initialize
        from megazoo.training.checkpoint import format as ckpt
        from megazoo.training.checkpoint.hf import load_model_chunks
        from megazoo.training.checkpoint.tokenizer import checkpoint_tokenizer, eos_token_ids
        folder = ckpt.resolve(load)
        sp = str(sequence_parallel).lower() in ("1", "true", "yes")
        topo = initialize(ParallelConfig(tp=int(tp), pp=int(pp), sequence_parallel=sp))
        _, chunks = load_model_chunks(folder, topo)
        tok = checkpoint_tokenizer(folder)
        eos = eos_token_ids(folder, ckpt.read_meta(folder)) or [tok.eod]
        self._set(chunks, topo, tok, eos, int(batch_size), int(max_gen_toks),
                  str(add_bos_token).lower() in ("1", "true", "yes"))

    @classmethod
    def of_chunks(cls, chunks, topo, tokenizer, eos_ids, batch_size: int = 8,
                  max_gen_toks: int = 256, add_bos_token: bool = False) -> "MegazooLM":
        """The model a training run holds (its chunks and layout), unchanged by evaluating."""
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self._set(chunks, topo, tokenizer, eos_ids, batch_size, max_gen_toks, add_bos_token)
        return self

    def _set(self, chunks, topo, tok, eos, batch_size, max_gen_toks, add_bos):
        self.scorer = Scorer(chunks, topo, batch_size)
        self.tok, self.eos_ids, self.max_gen_toks = tok, list(eos), max_gen_toks
        self.batch_size = batch_size
        self.bos_text, self.bos_id = bos_token(tok)
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos_token=true: the checkpoint's tokenizer names no "
                             "bos_token (tokenizer_config.json); drop add_bos_token")
        self.add_bos = bool(add_bos)

    # ---- what lm_eval asks of a model ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: bos when the tokenizer names one (as the HF
        backend does), else the end-of-document token."""
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        return type(self.tok).__name__

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The tokenizer's ids; with add_bos_token, bos first (unless the string starts with it
        or the caller asks for no special tokens), as the HF backend encodes."""
        ids = self.tok.encode(string)
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        if bos and self.bos_id is not None and not string.startswith(self.bos_text):
            ids = [self.bos_id] + ids
        return ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    def chat_template(self, chat_template=False):
        if not chat_template:
            return None
        template = getattr(self.tok, "chat_template", None)
        if not template:
            raise ValueError("--apply_chat_template: the checkpoint's tokenizer has no chat "
                             "template (tokenizer/chat_template.jinja or tokenizer_config.json)")
        return template

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template
        special = self.tok.special_tokens() if hasattr(self.tok, "special_tokens") else {}
        rendered, _ = render_jinja_template([chat_history], chat_template=self.chat_template(True),
                                            add_generation_prompt=add_generation_prompt, **special)
        return rendered[0]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it)."""
        inputs, targets, conts = [], [], []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            inputs.append(whole[:-1])
            targets.append(whole[1:])
            conts.append(list(continuation))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))  # similar lengths batch
        logps, greedy = self.scorer.run([inputs[i] for i in order], [targets[i] for i in order])
        out = [None] * len(inputs)
        for k, i in enumerate(order):
            n = len(conts[i])
            lp, gr = logps[k][-n:], greedy[k][-n:]
            out[i] = (float(sum(lp)), gr == targets[i][-n:])
        for req, result in zip(requests, out):
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(r.args for r in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += lp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until a stop string, an eos id or max_gen_toks, `batch_size` requests
        at a time (each new token from a full forward pass over the sequences so far, so every
        layout decodes alike)."""
        jobs = [self._job(*req.args) for req in requests]
        out = [None] * len(jobs)
        for start in range(0, len(jobs), self.batch_size):
            part = list(range(start, min(start + self.batch_size, len(jobs))))
            for i, text in zip(part, self._decode([jobs[i] for i in part])):
                out[i] = text
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _job(self, context: str, gen_kwargs) -> dict:
        kwargs = dict(gen_kwargs or {})
        if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
            raise ValueError("the megazoo model decodes greedily: set do_sample: false and "
                             "temperature: 0 in the task's generation_kwargs (or --gen_kwargs)")
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos_text = self.tok_decode([self.eot_token_id])
        if eos_text not in until:
            until.append(eos_text)
        max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        if max_gen >= self.max_length:
            raise ValueError(f"max_gen_toks {max_gen} must be below the model's {self.max_length} "
                             f"positions")
        ids = self.tok_encode(context)[-(self.max_length - max_gen):]
        return dict(ids=ids, start=len(ids), until=until, left=max_gen, done=max_gen == 0)

    def _decode(self, jobs: list[dict]) -> list[str]:
        while True:
            active = [j for j in jobs if not j["done"]]
            if not active:
                break
            _, greedy = self.scorer.run([j["ids"] for j in active])
            for j, row in zip(active, greedy):
                token = row[-1]
                if token in self.eos_ids:
                    j["done"] = True
                    continue
                j["ids"].append(token)
                j["left"] -= 1
                text = self.tok_decode(j["ids"][j["start"]:])
                j["done"] = j["left"] == 0 or any(u in text for u in j["until"])
        out = []
        for j in jobs:
            text = self.tok_decode(j["ids"][j["start"]:])
            for u in j["until"]:
                text = text.split(u)[0]
            out.append(text)
        return out
