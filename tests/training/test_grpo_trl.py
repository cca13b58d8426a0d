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
