"""The tokenizer travels with the checkpoint, and generation stops where `transformers` stops.

- A chat model (Qwen2, untied) imported from a folder whose tokenizer is only vocab.json +
  merges.txt + tokenizer_config.json (with a chat template), config.json eos = <|im_end|> and
  generation_config.json eos = [<|im_end|>, <|endoftext|>]: `tools/generate.py --chat` (no
  tokenizer flag) prints transformers' reply, stopped at <|im_end|>.
- A GPT trained with --vocab-file/--merge-file (GPT2BPETokenizer) -> generate.py without tokenizer
  flags uses that tokenizer; import -> fine-tune (no tokenizer flag) -> export keeps the tokenizer
  files and the special-token ids, and transformers loads the exported folder with its tokenizer.
- Export keeps the imported model's dtype (bf16), `--dtype` overrides it.
"""
import contextlib
import io
import json
import os

import torch

from tests.distributed import run_distributed
from tests.tokenizer_data import tokenizer_folders
from tests.tool_runs import convert_hf_tool, tool_module

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _generate(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = tool_module("generate").main(list(argv))
    return rc, out.getvalue().strip()


def test_chat_prompt_stops_at_the_end_of_turn_token(tmp_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from megazoo.training.checkpoint.hf import import_hf
    full, mini, _ = tokenizer_folders(tmp_path, "qwen2", old_config=True)
    for folder in (full, mini):
        path = os.path.join(folder, "tokenizer_config.json")
        config = json.load(open(path))
        json.dump({**config, "chat_template": CHAT_TEMPLATE}, open(path, "w"))
    hf_tok = AutoTokenizer.from_pretrained(full)
    im_end, eot = hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(hf_tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        eos_token_id=im_end, bos_token_id=None, pad_token_id=None)).eval()
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "Say hi"}],
                                        add_generation_prompt=True, return_dict=False)
    prompt = torch.tensor([prompt])
    with torch.no_grad():  # make the model end its turn: its 3rd greedy token becomes <|im_end|>
        free = hf.generate(prompt, max_new_tokens=3, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, prompt.shape[1]:]
        assert im_end not in free.tolist() and eot not in free.tolist()
        head = hf.lm_head.weight
        head[[int(free[2]), im_end]] = head[[im_end, int(free[2])]]
    hf.generation_config.eos_token_id = [im_end, eot]
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    for f in os.listdir(mini):  # the vocab.json + merges.txt folder only
        os.link(os.path.join(mini, f), hf_dir / f)
    assert json.load(open(hf_dir / "generation_config.json"))["eos_token_id"] == [im_end, eot]
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert ref[-1] == im_end and len(ref) == 3
    ckpt = str(tmp_path / "mz")
    import_hf(str(hf_dir), ckpt)
    rc, text = _generate("--load", ckpt, "--chat", "--prompt", "Say hi", "--max-new-tokens", "12")
    assert rc == 0 and text == hf_tok.decode(ref[:-1])
    rc, text = _generate("--load", ckpt, "--prompt", "Say hi", "--max-new-tokens", "12")
    assert rc == 0  # without --chat: a plain continuation


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--log-interval", "100", "--eval-interval", "1000", "--train-iters", "2"]


def _train(rank, argv):
    from megazoo.training.run.entry import main
    return main("gpt2", argv).checkpoint  # train_gpt.py


def test_tokenizer_travels_through_training_fine_tuning_and_export(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from megazoo.training.checkpoint.tokenizer import read_record
    from megazoo.training.checkpoint.hf import export_hf, import_hf
    _, mini, hf_tok = tokenizer_folders(tmp_path, "gpt2", old_config=True)
    vocab, merges = os.path.join(mini, "vocab.json"), os.path.join(mini, "merges.txt")
    # 1. training with GPT-2 BPE files -> generate.py without tokenizer flags
    trained = str(tmp_path / "trained")
    run_distributed(_train, 1, TINY + ["--vocab-file", vocab, "--merge-file", merges,
                                       "--save", trained], timeout=300)
    assert read_record(os.path.join(trained, "tokenizer"))["tokenizer_type"] == "GPT2BPETokenizer"
    rc, text = _generate("--load", trained, "--prompt", "Hello world", "--max-new-tokens", "3")
    assert rc == 0 and text.startswith("Hello world")

    # 2. import (a bf16 model with special-token ids) -> fine-tune without tokenizer flags -> export
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=len(hf_tok), n_positions=16, n_embd=32, n_layer=2,
                                    n_head=4, bos_token_id=7, eos_token_id=[9, 11]))
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    for f in os.listdir(mini):
        os.link(os.path.join(mini, f), tmp_path / "hf" / f)
    imported, tuned = str(tmp_path / "imported"), str(tmp_path / "tuned")
    import_hf(str(tmp_path / "hf"), imported)
    out = str(tmp_path / "export_imported")
    export_hf(imported, out)  # the imported model's own dtype
    assert all(t.dtype == torch.bfloat16 for t in load_file(os.path.join(out, "model.safetensors")).values())
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert convert_hf_tool("export", "--load", imported, "--save", out + "32", "--dtype", "float32") == 0
    assert all(t.dtype == torch.float32 for t in load_file(os.path.join(out + "32", "model.safetensors")).values())

    run_distributed(_train, 1, TINY + ["--vocab-size", str(len(hf_tok)), "--load", imported,
                                       "--finetune", "--save", tuned], timeout=300)
    record = read_record(os.path.join(tuned, "tokenizer"))
    assert record["tokenizer_type"] == "HuggingFaceTokenizer" and record["eos_token_id"] == [9, 11]
    out = str(tmp_path / "export_tuned")
    export_hf(tuned, out)
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(os.listdir(out))
    back = json.load(open(os.path.join(out, "config.json")))
    assert (back["bos_token_id"], back["eos_token_id"]) == (7, [9, 11])
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("Hello world") == hf_tok.encode("Hello world")
    rc, text = _generate("--load", tuned, "--prompt", "Hello world", "--max-new-tokens", "3")
    assert rc == 0 and text.startswith("Hello world")

    # 3. a checkpoint without a tokenizer: one line naming the folder and the flag
    bare = str(tmp_path / "bare")
    run_distributed(_train, 1, TINY + ["--vocab-size", "61", "--save", bare], timeout=300)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc, _ = _generate("--load", bare, "--prompt", "Hello")
    assert rc == 1 and "--tokenizer-model" in err.getvalue() and err.getvalue().count("\n") == 1

    # 4. NullTokenizer (pre-tokenized ids): recorded, rebuilt from the model's vocabulary
    null = str(tmp_path / "null")
    run_distributed(_train, 1, TINY + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
                                       "--save", null], timeout=300)
    rc, text = _generate("--load", null, "--prompt", "1 2 3", "--max-new-tokens", "2", "--no-eos-stop")
    assert rc == 0 and text.startswith("1 2 3 ") and len(text.split()) == 5
