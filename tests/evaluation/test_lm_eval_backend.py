"""megazoo as an lm-evaluation-harness model against lm-eval's own HF backend on the exported
model: per-item log-likelihoods within 1e-5 and the same scores on a local multiple-choice and a
local generation task, at tp1 (in process) and tp2 / pp2 (one spawned 2-rank world)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.fixtures import HERE as FIXTURES
from tests.tokenizer_data import CHATML_PLAIN, tokenizer_folders

TASKS = [str(FIXTURES / "lm_eval" / "tiny_mc.yaml"), str(FIXTURES / "lm_eval" / "tiny_gen.yaml")]
ATOL = 1e-5


def _evaluate(model, model_args=None):
    """(per-item log-likelihoods of the mc task, per-item generations, scores)."""
    from lm_eval import simple_evaluate
    from megazoo.training.evaluation.tasks import flat_scores, task_manager
    out = simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                          task_manager=task_manager(TASKS), log_samples=True, bootstrap_iters=0,
                          verbosity="WARNING")
    if out is None:
        return None
    lls = [[r[0] for r in s["filtered_resps"]] for s in out["samples"]["tiny_mc"]]
    gens = [s["filtered_resps"][0] for s in out["samples"]["tiny_gen"]]
    return lls, gens, flat_scores(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random GPT-2 (HF), its megazoo import and the HF export of that import, and the HF
    backend's results on the export."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from megazoo.training.checkpoint.hf import export_hf, import_hf
    tmp = tmp_path_factory.mktemp("lm_eval")
    _, mini, hf_tok = tokenizer_folders(tmp, "gpt2", old_config=True)
    config = json.loads(open(os.path.join(mini, "tokenizer_config.json")).read())
    with open(os.path.join(mini, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "chat_template": CHATML_PLAIN}, f)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=len(hf_tok), n_positions=32, n_embd=32, n_layer=2,
                                    n_head=4, eos_token_id=50256, bos_token_id=50256))
    hf.save_pretrained(tmp / "hf")
    for f in os.listdir(mini):
        os.link(os.path.join(mini, f), tmp / "hf" / f)
    ckpt, exported = str(tmp / "megazoo"), str(tmp / "exported")
    import_hf(str(tmp / "hf"), ckpt)
    export_hf(ckpt, exported)
    from lm_eval.models.huggingface import HFLM
    hf_lm = HFLM(pretrained=exported, dtype="float32", device="cpu", batch_size=4)
    return ckpt, _evaluate(hf_lm), hf_lm


def _check(got, reference):
    lls, gens, scores = got
    ref_lls, ref_gens, ref_scores = reference
    assert len(lls) == len(ref_lls) == 6
    diff = max(abs(a - b) for row, ref in zip(lls, ref_lls) for a, b in zip(row, ref, strict=True))
    assert diff <= ATOL, diff
    assert gens == ref_gens
    assert scores == ref_scores
    print(f"largest log-likelihood difference {diff:.2e}; generations {gens}")
    return diff


ROLLING = ["The quick brown fox jumps over the lazy dog. " * 6, "Hello world", "naïve café 123"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_tp1_matches_hf_backend(models):
    from lm_eval.api.instance import Instance
    from megazoo.training.evaluation.harness import MegazooLM
    ckpt, reference, hf_lm = models
    lm = MegazooLM(load=ckpt, batch_size=4)
    _check(_evaluate(lm), reference)
    # perplexity: rolling windows past the 32 positions, against the HF backend's
    reqs = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(ROLLING)]
    got, ref = lm.loglikelihood_rolling(reqs), hf_lm.loglikelihood_rolling(reqs)
    assert all(abs(a - b) <= ATOL * max(1.0, abs(b)) for a, b in zip(got, ref, strict=True)), (got, ref)
    # the checkpoint's chat template renders as the HF backend renders the exported one
    assert lm.apply_chat_template(CHAT) == hf_lm.apply_chat_template(CHAT)
    assert lm.tok_encode(lm.apply_chat_template(CHAT)) == hf_lm.tok_encode(hf_lm.apply_chat_template(CHAT))


def _layouts(rank, ckpt):
    from megazoo.training.evaluation.harness import register
    register()
    out = []
    for args in (dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2)):
        out.append(_evaluate("megazoo", dict(load=ckpt, batch_size=3, **args)))
    return out


def test_tp2_and_pp2_match_hf_backend(models):
    ckpt, reference, _ = models
    results = run_distributed(_layouts, 2, ckpt, timeout=240)
    checked = [_check(got, reference) for got in results[0]]
    assert len(checked) == 3
