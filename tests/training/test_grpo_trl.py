"""GRPO's loss against TRL's GRPOTrainer on one fixed batch: the same tiny Llama (imported into
megazoo), 2 prompts x a group of 2 completions of different lengths, rewards, old and reference
log-probabilities set apart from the model's (so ratios clip and the KL term counts). TRL's
`_compute_loss` and megazoo's `grpo_loss` over `completion_logps` (at tp1; the per-token
log-probabilities are the model's vocabulary-parallel loss, compared at tp2 in the LoRA and SFT
tests) agree within 1e-6 for every loss type, and so do the gradients of the output head.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.hf_models import chat_llama_folder
from tests.tokenizer_data import CHATML_PLAIN

PROMPT, COMPLETION, GROUP, BETA = 5, 6, 2, 0.04
WORDS = "a b c d e f g h i j k l m n o p"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import nanstd
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.hf import import_hf, load_model_chunks
    from megazoo.training.run.grpo import group_advantages
    root = str(tmp_path_factory.mktemp("grpo"))
    folder = chat_llama_folder(root, [WORDS], CHATML_PLAIN)
    import_hf(folder, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=1)
    cfg = GRPOConfig(output_dir=os.path.join(root, "trl"), num_generations=GROUP, per_device_train_batch_size=4,
                     max_completion_length=COMPLETION, beta=BETA, epsilon=0.2, epsilon_high=0.28,
                     report_to=[], use_cpu=True, save_strategy="no", bf16=False, fp16=False,
                     temperature=1.0, disable_tqdm=True, logging_steps=1)
    trainer = GRPOTrainer(model=folder, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=cfg, train_dataset=datasets.Dataset.from_list([{"prompt": "a b"}] * 4),
                          processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(3)
    vocab = trainer.model.config.vocab_size
    tokens = torch.randint(3, vocab, (4, PROMPT + COMPLETION), generator=g)
    mask = torch.tensor([[1] * n + [0] * (COMPLETION - n) for n in (6, 3, 5, 1)])
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9])
    advantages = group_advantages(rewards, GROUP)
    by_trl = (rewards - rewards.view(-1, GROUP).mean(1).repeat_interleave(GROUP)) / \
        (nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP) + 1e-4)
    with torch.no_grad():
        hf_logps = torch.log_softmax(trainer.model(tokens).logits[:, PROMPT - 1:-1].float(), -1).gather(
            -1, tokens[:, PROMPT:, None]).squeeze(-1)
    old = hf_logps + 0.3 * torch.randn(hf_logps.shape, generator=g)
    ref = hf_logps + 0.2 * torch.randn(hf_logps.shape, generator=g)
    inputs = dict(prompt_ids=tokens[:, :PROMPT], prompt_mask=torch.ones(4, PROMPT, dtype=torch.long),
                  completion_ids=tokens[:, PROMPT:], completion_mask=mask, advantages=advantages,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=mask.sum().float())
    topo = ParallelTopology.from_config(ParallelConfig())
    _, chunks = load_model_chunks(ckpt.resolve(os.path.join(root, "ckpt")), topo)
    return dict(trainer=trainer, inputs=inputs, chunk=chunks[0].train(), tokens=tokens, mask=mask,
                advantages=advantages, by_trl=by_trl, old=old, ref=ref)


def test_group_advantages_as_trl_normalises_rewards(setup):
    torch.testing.assert_close(setup["advantages"], setup["by_trl"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_loss_and_head_gradient_equal_trl(setup, loss_type):
    from megazoo.training.run.grpo import completion_logps, grpo_loss
    trainer, chunk = setup["trainer"], setup["chunk"]
    trainer.loss_type = loss_type
    trainer.model.zero_grad()
    theirs = trainer._compute_loss(trainer.model, setup["inputs"])
    theirs.backward()
    chunk.zero_grad()
    logps = completion_logps(chunk, setup["tokens"], COMPLETION)
    ours, stats = grpo_loss(logps, setup["old"], setup["advantages"], setup["mask"], ref_logps=setup["ref"],
                            beta=BETA, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type,
                            max_completion_length=COMPLETION)
    ours.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(abs(theirs.item()), 1.0), (ours.item(), theirs.item())
    torch.testing.assert_close(chunk.head_weight.grad, trainer.model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)
    assert 0.0 < stats["clip_ratio"] < 1.0 and stats["kl"] > 0.0


def first_word(prompts, completions, **kw):
    return [1.0 if c.startswith("a") else 0.0 for c in completions]


def length_or_none(prompts, completions, **kw):
    return [None if len(c) > 3 else float(len(c)) for c in completions]


def test_weighted_rewards_equal_trl(setup):
    """Two reward functions (one answering None for some completions) with --reward-weights:
    TRL's _calculate_rewards per function, weighted as TRL sums them."""
    from megazoo.training.run.grpo_online import combine_rewards
    trainer = setup["trainer"]
    funcs, weights = [first_word, length_or_none], [0.7, -0.25]
    trainer.reward_funcs, trainer.reward_processing_classes = funcs, [None, None]
    trainer.reward_func_names = ["first_word", "length_or_none"]
    completions = ["a b", "b c d e", "a", "c d e f g"]
    per_func = trainer._calculate_rewards([{"prompt": "x"}] * 4, ["x"] * 4, completions, [[1]] * 4)
    theirs = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    ours_cols = torch.tensor([[float("nan") if x is None else x for x in f(prompts=None, completions=completions)]
                              for f in funcs]).T
    torch.testing.assert_close(ours_cols, per_func.cpu(), equal_nan=True)
    torch.testing.assert_close(combine_rewards(ours_cols, weights), theirs.cpu(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="--reward-weights gives 1 weights for 2"):
        combine_rewards(ours_cols, [1.0])


def test_truncated_completions_masked_as_trl(setup):
    """--mask-truncated-completions: a completion whose kept tokens hold no eos loses its loss
    mask (TRL: its last token is not eos); the loss then equals TRL's on the masked batch."""
    from megazoo.training.run.grpo import completion_logps, grpo_loss
    from megazoo.training.run.grpo_online import truncated
    eos = 2
    completion = setup["tokens"][:, PROMPT:].clone()
    mask = setup["mask"]
    ends = mask.sum(1) - 1
    completion[0, ends[0]] = eos  # rows 0 and 2 end with eos; rows 1 and 3 are cut off
    completion[2, ends[2]] = eos
    completion[1:2] = torch.where(completion[1:2] == eos, 3, completion[1:2])
    completion[3:4] = torch.where(completion[3:4] == eos, 3, completion[3:4])
    cut = truncated(mask, completion, (eos,))
    kept = [row[:m.sum()].tolist() for row, m in zip(completion, mask)]
    assert cut.tolist() == [ids[-1] not in (eos,) for ids in kept] == [False, True, False, True]
    masked = mask * (~cut).long().unsqueeze(1)
    tokens = torch.cat([setup["tokens"][:, :PROMPT], completion], 1)
    trainer, chunk = setup["trainer"], setup["chunk"]
    trainer.loss_type = "dapo"
    inputs = dict(setup["inputs"], completion_ids=completion, completion_mask=masked,
                  num_items_in_batch=masked.sum().float())
    theirs = trainer._compute_loss(trainer.model, inputs)
    ours, _ = grpo_loss(completion_logps(chunk, tokens, COMPLETION), setup["old"], setup["advantages"], masked,
                        ref_logps=setup["ref"], beta=BETA, epsilon_low=0.2, epsilon_high=0.28)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(abs(theirs.item()), 1.0), (ours.item(), theirs.item())
