"""LoRA against PEFT itself, on the same tiny Hugging Face Llama and chat data.

PEFT wraps the model (r 4, alpha 8, every projection, random A and B: `init_lora_weights=False`,
so the adapters change the output from step 1) and writes its starting adapter; megazoo starts
from that folder (`--lora-init`) on the imported base with `--sft`, and a plain torch AdamW loop
trains PEFT's model on the same conversations with the same loss (assistant tokens, summed over
the global batch and divided by their number; one global batch = the whole set, so both see the
same tokens every step). Then megazoo's checkpoint is exported both ways: the adapter folder
loaded by `PeftModel.from_pretrained` gives megazoo's logits, and the merged export equals
PEFT's `merge_and_unload` of it. One spawned 2-rank world trains the same run at tp2 and at dp2
with ZeRO-1: losses equal to the single process's, adapters within the trained tolerance.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import chat_llama_argv, chat_llama_folder, run_llama
from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.tokenizer_data import CHATML_TAGGED
from tests.tolerances import assert_trained_close
from tests.tool_runs import load_tool

LORA = dict(r=4, lora_alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                         "up_proj", "down_proj"])
HYPER = dict(lr=1e-2, micro_batch=4, global_batch=8, seq=32)
STEPS = 10
TOPICS = ["the sea", "a red kite", "bread", "rain on tin", "an old clock", "snow", "a river", "tea"]


def conversations() -> list[dict]:
    """8 one-turn conversations (one global batch), replies of 1 to 9 words (<= 33 tokens)."""
    return [{"messages": [{"role": "system", "content": "answer briefly"},
                          {"role": "user", "content": f"tell me about {t}"},
                          {"role": "assistant", "content": " ".join(([t, "is", "fine"] * 4)[:1 + (i * 3) % 9])}]}
            for i, t in enumerate(TOPICS)]


def peft_model(folder: str, adapter: str | None = None):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        return PeftModel.from_pretrained(base, adapter)
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0,
                                           target_modules=LORA["targets"], init_lora_weights=False))


def batch(folder: str, data: list[dict]):
    """Right-padded ids, attention mask and assistant mask (transformers' chat template)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True) for c in data]
    n = max(len(r["input_ids"]) for r in rows)
    assert n <= HYPER["seq"] + 1
    pad = lambda xs, v: [list(x) + [v] * (n - len(x)) for x in xs]  # noqa: E731
    return (torch.tensor(pad([r["input_ids"] for r in rows], 0)),
            torch.tensor(pad([r["attention_mask"] for r in rows], 0)),
            torch.tensor(pad([r["assistant_masks"] for r in rows], 0)))


def peft_losses(model, ids, attention, assistant) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=HYPER["lr"],
                            betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        mask = assistant[:, 1:].flatten().float()
        loss = (ce * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def megazoo_argv(root: str, folder: str, init: str, save: str, *extra) -> list[str]:
    h = HYPER
    return chat_llama_argv(folder, os.path.join(root, "ckpt"), os.path.join(root, "chat"), h["seq"],
                           "--sft", "--micro-batch-size", h["micro_batch"], "--global-batch-size",
                           h["global_batch"], "--train-iters", STEPS, "--lr", h["lr"], "--min-lr", h["lr"],
                           "--log-interval", STEPS, "--lora-init", init, "--save", save,
                           "--save-interval", STEPS, *extra)


def _layouts_worker(rank: int, root: str, folder: str, init: str) -> dict:
    out = {}
    for name, extra in (("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("dp2", ["--zero-stage", "1", "--use-distributed-optimizer"])):
        out[name] = run_llama(megazoo_argv(root, folder, init, os.path.join(root, name), *extra),
                                world=2).losses
    return out


def adapters(save: str) -> dict[str, torch.Tensor]:
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.reshard import read_full_state
    full = read_full_state(ckpt.resolve(save))
    return {k: v for k, v in {**full.weights, **full.master}.items() if ".lora." in k}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    data = conversations()
    with open(os.path.join(root, "chat.jsonl"), "w") as f:
        f.write("".join(json.dumps(c) + "\n" for c in data))
    folder = chat_llama_folder(root, [m["role"] + " " + m["content"] for c in data for m in c["messages"]],
                               CHATML_TAGGED)
    init = os.path.join(root, "init")
    theirs = peft_model(folder)
    theirs.save_pretrained(init)
    start = {k: v.clone() for k, v in theirs.state_dict().items() if "lora" in k}
    ids, attention, assistant = batch(folder, data)
    peft = peft_losses(theirs, ids, attention, assistant)
    from megazoo.training.checkpoint.hf import import_hf
    import_hf(folder, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=1)
    sft = load_tool("preprocess_sft")
    sft.preprocess(sft.parse_args(["--input", os.path.join(root, "chat.jsonl"), "--output-prefix",
                                   os.path.join(root, "chat"), "--tokenizer-model", folder,
                                   "--seq-length", str(HYPER["seq"])]))
    ours = run_llama(megazoo_argv(root, folder, init, os.path.join(root, "one")), world=1).losses
    layouts = run_distributed(_layouts_worker, 2, root, folder, init, timeout=300)[0]
    return dict(root=root, folder=folder, init=init, peft=peft, ours=ours, layouts=layouts,
                ids=ids, start=start)


def test_losses_equal_peft_with_a_plain_adamw_loop(runs):
    assert len(runs["ours"]) == len(runs["peft"]) == STEPS
    for i, (a, b) in enumerate(zip(runs["ours"], runs["peft"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: megazoo {a}, PEFT {b}"


def test_tp2_and_dp2_zero_equal_the_single_process(runs):
    root = runs["root"]
    want = adapters(os.path.join(root, "one"))
    start = {k: torch.zeros_like(v) for k, v in want.items()}  # movement floor only needs a scale
    for name in ("tp2", "dp2"):
        got = runs["layouts"][name]
        assert len(got) == STEPS
        for i, (a, b) in enumerate(zip(got, runs["ours"]), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {i}: {a} vs {b}"
        assert_trained_close(adapters(os.path.join(root, name)), want, start, name, HYPER["lr"])


def test_exported_adapter_loads_in_peft_and_merges_like_merge_and_unload(runs):
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.training.checkpoint import format as ckpt
    from megazoo.training.checkpoint.hf import export_hf, load_model_chunks
    from megazoo.models.language_model import gather_logits
    root, ids = runs["root"], runs["ids"]
    save = os.path.join(root, "one")
    from megazoo.training.checkpoint.hf import ConversionError
    from megazoo.training.checkpoint.resume import check_lora
    from megazoo.models.lora_targets import LoRASettings
    with pytest.raises(ConversionError, match="holds LoRA adapters: add --merge-lora .* or --lora-adapter-dir"):
        export_hf(save, os.path.join(root, "refused"))
    record = LoRASettings(rank=4, alpha=8, targets=tuple(LORA["targets"])).record()
    with pytest.raises(ckpt.CheckpointError, match="holds LoRA adapters .*: add --lora-rank 4 --lora-alpha 8"):
        check_lora(record, None, save)
    with pytest.raises(ckpt.CheckpointError, match="this run asks for"):
        check_lora(record, LoRASettings(rank=2, alpha=8, targets=tuple(LORA["targets"])), save)
    export_hf(save, os.path.join(root, "base_out"), adapter_dir=os.path.join(root, "adapter_out"))
    export_hf(save, os.path.join(root, "merged_out"), merge_lora=True)
    from megazoo.training.checkpoint.reshard import read_full_state
    from tests.tool_runs import tool_module
    tool_module("reshard").reshard(save, os.path.join(root, "tp2_copy"), tp=2, pp=1, dp=2, zero_stage=1)
    resharded = read_full_state(ckpt.resolve(os.path.join(root, "tp2_copy")))
    assert ckpt.read_meta(ckpt.resolve(os.path.join(root, "tp2_copy")))["lora"]["rank"] == LORA["r"]
    for k, v in adapters(save).items():  # the adapters and their optimizer states travel
        assert torch.equal(resharded.weights[k], v) and k in resharded.optim["exp_avg"], k
    topo = ParallelTopology.from_config(ParallelConfig())
    _, chunks = load_model_chunks(ckpt.resolve(save), topo)
    with torch.no_grad():
        ours = gather_logits(chunks[0](ids), topo, chunks[0].config.vocab_size)
        peft = peft_model(os.path.join(root, "base_out"), os.path.join(root, "adapter_out")).eval()
        theirs = peft(input_ids=ids).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        merged_ref = peft.merge_and_unload().state_dict()
    from safetensors.torch import load_file
    merged = load_file(os.path.join(root, "merged_out", "model.safetensors"))
    assert set(merged) == set(merged_ref)
    for k, v in merged.items():
        torch.testing.assert_close(v, merged_ref[k], rtol=1e-6, atol=1e-6, msg=k)
