"""Hugging Face Llama folders through megazoo's conversion tools (training/checkpoint/hf.py, as
tools/convert_hf.py runs it), against `transformers` (fp32).

A GQA model (8 query heads, 2 KV heads, untied, llama3 rope) and an MQA model (1 KV head, tied,
linear rope) are imported at (tp, pp, vpp) = (2, 2, 2) and (4, 1, 1), exported back (identical
tensors), and loaded in one 4-rank world under (4, 1, 1) (KV heads replicated), (2, 2, 2) and
(1, 4, 1): logits match `transformers` within 1e-5 and, with pp = 1, greedy generation with the
KV cache under TP equals `generate(do_sample=False)` token for token, eos padding included. The
MQA model goes through the command-line tools: tools/convert_hf.py import, and tools/generate.py
at tp = 4 with a tokenizer folder, whose text equals HF's greedy continuation.
"""
import torch

from tests.distributed import run_distributed
from tests.hf_models import LLAMA3, hf_llama

IMPORT_LAYOUTS = {"gqa": (2, 2, 2), "mqa": (4, 1, 1)}  # (tp, pp, vpp)
LOAD_LAYOUTS = [(4, 1, 1), (2, 2, 2), (1, 4, 1)]
NEW_TOKENS = 8


def _worker(rank, cases, tool_case):
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from tests.hf_models import check_against_hf
    from tests.tool_runs import generate_tool
    errors = [0.0]
    for tp, pp, vpp in LOAD_LAYOUTS:
        topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
        for case in cases:
            errors.append(check_against_hf(case, topo, NEW_TOKENS)[1])
    text = generate_tool(["--load", tool_case["ckpt"], "--prompt", tool_case["prompt"],
                          "--max-new-tokens", str(NEW_TOKENS), "--no-eos-stop"])
    return max(errors), text


def test_llama_import_export_logits_and_generation(tmp_path):
    from transformers import LlamaForCausalLM

    from tests.hf_models import save_word_tokenizer, hf_reference
    from tests.tool_runs import convert_hf_tool
    from megazoo.training.checkpoint.hf import export_hf, import_hf
    models = {"gqa": hf_llama(hidden=64, heads=8, kv_heads=2, layers=4, scaling=LLAMA3),
              "mqa": hf_llama(hidden=32, heads=4, kv_heads=1, layers=4, tied=True,
                              scaling={"rope_type": "linear", "factor": 2.0})}
    ids = torch.randint(0, 101, (3, 17), generator=torch.Generator().manual_seed(1))
    prompt = ids[:2, :5]
    cases = []
    for name, hf in models.items():
        hf_dir = str(tmp_path / f"hf_{name}")
        hf.save_pretrained(hf_dir)
        hf_ref = hf_reference(hf, ids, prompt, NEW_TOKENS)
        tp, pp, vpp = IMPORT_LAYOUTS[name]
        ckpt = str(tmp_path / f"mz_{name}")
        if name == "mqa":  # through the command-line tools, with a tokenizer
            tok = save_word_tokenizer(hf_dir)
            words = "w7 w42 w3"
            with torch.no_grad():
                ref = hf.generate(torch.tensor([tok.encode(words).ids]), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            tool_case = dict(prompt=words, text=tok.decode(ref[0].tolist()), ckpt=ckpt)
            assert convert_hf_tool("import", "--hf-dir", hf_dir, "--save", ckpt,
                                   "--tensor-model-parallel-size", str(tp),
                                   "--pipeline-model-parallel-size", str(pp)) == 0
        else:
            import_hf(hf_dir, ckpt, tp=tp, pp=pp, vpp=vpp)
        cases.append(dict(hf_ref, name=name, ckpt=ckpt))
        out = str(tmp_path / f"back_{name}")
        export_hf(ckpt, out)  # HF -> megazoo (tp, pp, vpp) -> HF gives identical tensors
        back = LlamaForCausalLM.from_pretrained(out, local_files_only=True)
        assert back.config.num_key_value_heads == hf.config.num_key_value_heads
        assert back.config.rope_parameters == hf.config.rope_parameters
        ref_sd, back_sd = hf.state_dict(), back.state_dict()
        assert ref_sd.keys() == back_sd.keys()
        for k in ref_sd:
            assert torch.equal(ref_sd[k], back_sd[k]), (name, k)
    results = run_distributed(_worker, 4, cases, tool_case, timeout=400)
    assert max(r[0] for r in results) <= 1e-5
    assert results[0][1] == tool_case["text"] and len(tool_case["text"].split()) == 3 + NEW_TOKENS
