"""Hugging Face <-> megazoo conversion and generation, against `transformers` (fp32).

One spawned world of 4 ranks runs every (import layout x load layout) pair for a random GPT-2 and
a random BLOOM (vocabulary 101: padded; 12 heads: not a power of two): logits match
`transformers` within 1e-5 and, with pp=1, greedy generation (KV cache, TP) equals
`generate(do_sample=False)` token for token, eos padding included.
"""
import json
import os
import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import VOCAB, check_against_hf, hf_reference, save_word_tokenizer
from tests.tool_runs import convert_hf_tool, generate_tool

IMPORT_LAYOUTS = [(2, 2, 2), (4, 1, 1)]  # (tp, pp, vpp)
LOAD_LAYOUTS = [(2, 2, 2), (4, 1, 1), (1, 4, 1), (2, 1, 1)]
NEW_TOKENS = 8


def _hf_models():
    # imported here, not at module level: spawned ranks re-import this module, and transformers
    # costs seconds per process
    from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=4,
                                      n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                      bos_token_id=0, eos_token_id=0))
    bloom = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=4, n_head=12,
                                         hidden_dropout=0, attention_dropout=0,
                                         bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF inits biases to 0 and norms to 1, which would hide mistakes
        for model in (gpt2, bloom):
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return {"gpt2": gpt2.eval(), "bloom": bloom.eval()}


def _save_hf(name, model, folder):
    if name == "gpt2":  # sharded safetensors with an index
        model.save_pretrained(folder, max_shard_size="40KB")
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    else:  # a (sharded) pytorch_model.bin: loaded with weights_only=True
        model.config.save_pretrained(folder)
        sd, half = model.state_dict(), len(model.state_dict()) // 2
        parts = [dict(list(sd.items())[:half]), dict(list(sd.items())[half:])]
        index = {"weight_map": {}}
        for i, part in enumerate(parts):
            fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
            torch.save(part, os.path.join(folder, fname))
            index["weight_map"].update({k: fname for k in part})
        json.dump(index, open(os.path.join(folder, "pytorch_model.bin.index.json"), "w"))


def _worker(rank, cases, tool_case):
    from megazoo.models.generation import SamplingConfig, generate
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    errors, samples = [], []
    for tp, pp, vpp in LOAD_LAYOUTS:  # creating groups is slow: one topology per layout
        topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
        for case in cases:
            chunks, error = check_against_hf(case, topo, NEW_TOKENS)
            errors.append(error)
            if pp == 1:
                top1 = generate(chunks[0], topo, case["prompt"], NEW_TOKENS,
                                SamplingConfig(greedy=False, top_k=1, eos_id=case["eos"]))
                assert torch.equal(top1, case["greedy"])
                g = torch.Generator().manual_seed(1000 + rank)  # differs per rank: broadcast wins
                sampled = generate(chunks[0], topo, case["prompt"], NEW_TOKENS,
                                   SamplingConfig(greedy=False, top_k=20, top_p=0.9,
                                                  temperature=0.8), generator=g)
                samples.append(((case["ckpt"], tp, topo.dp_rank), sampled))
    # tools/generate.py under tp=4 (the world size), text through the imported tokenizer folder
    # prompts of two lengths: batched by length, printed in the order given
    text = generate_tool(["--load", tool_case["ckpt"], "--prompt", tool_case["prompt"],
                          "--prompt", tool_case["short_prompt"], "--prompt", tool_case["prompt"],
                          "--max-new-tokens", str(NEW_TOKENS), "--no-eos-stop"])
    return max(errors), samples, text


def test_import_export_logits_and_generation(tmp_path, capsys):
    from megazoo.training.checkpoint.hf import export_hf, import_hf
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    prompt = ids[:2, :5]
    cases = []
    for name, hf in _hf_models().items():
        hf_dir = str(tmp_path / f"hf_{name}")
        _save_hf(name, hf, hf_dir)
        if name == "gpt2":
            tok = save_word_tokenizer(hf_dir)
            words = "w7 w42 w3"
            with torch.no_grad():
                ref = hf.generate(torch.tensor([tok.encode(words).ids]), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
                short = hf.generate(torch.tensor([tok.encode("w5").ids]), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            tool_case = dict(prompt=words, text=tok.decode(ref[0].tolist()), short_prompt="w5",
                             short_text=tok.decode(short[0].tolist()),
                             ckpt=str(tmp_path / "mz_gpt2_222"))
        ref = hf_reference(hf, ids, prompt, NEW_TOKENS)
        for tp, pp, vpp in IMPORT_LAYOUTS:
            ckpt = str(tmp_path / f"mz_{name}_{tp}{pp}{vpp}")
            import_hf(hf_dir, ckpt, tp=tp, pp=pp, vpp=vpp)
            cases.append(dict(ref, family=name, ckpt=ckpt))
            # HF -> megazoo (tp, pp) -> HF gives identical tensors
            out = str(tmp_path / f"back_{name}_{tp}{pp}{vpp}")
            export_hf(ckpt, out)
            cls = type(hf)
            back = cls.from_pretrained(out, local_files_only=True)
            ref_sd, back_sd = hf.state_dict(), back.state_dict()
            assert ref_sd.keys() == back_sd.keys()
            for k in ref_sd:
                assert torch.equal(ref_sd[k], back_sd[k]), k
            assert back.config.eos_token_id == 0 and back.config.vocab_size == VOCAB
            assert os.path.exists(os.path.join(out, "tokenizer.json")) == (name == "gpt2")

    results = run_distributed(_worker, 4, cases, tool_case, timeout=400)
    assert max(r[0] for r in results) <= 1e-5
    assert results[0][2].split("\n") == [tool_case["text"], tool_case["short_text"], tool_case["text"]]
    assert len(tool_case["text"].split()) == 3 + NEW_TOKENS
    assert all(r[2] == "" for r in results[1:])  # rank 0 prints
    by_group = {}
    for _, samples, _ in results:  # sampling: every TP rank of a group emits the same tokens
        for key, tokens in samples:
            by_group.setdefault(key, []).append(tokens)
    assert len(by_group) == 4 * (1 + 2)  # 4 imports x (tp4 + tp2 x dp2)
    for key, outs in by_group.items():
        assert all(torch.equal(outs[0], o) for o in outs), key
        assert outs[0].shape[1] <= 5 + NEW_TOKENS and int(outs[0].max()) < VOCAB

    # Replicas that drifted apart across TP ranks are refused on export, in one line naming the
    # tensor and the largest difference (averaging them would hide ranks that diverged).
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / "mz_gpt2_411" / "iter_0000000" / "rank_00001.safetensors")
    tensors = load_file(path)
    key = "model.0.layers.0.input_norm.weight"  # replicated over the 4 TP ranks
    tensors[key] = tensors[key] + 0.4
    save_file(tensors, path)
    capsys.readouterr()
    assert convert_hf_tool("export", "--load", str(tmp_path / "mz_gpt2_411"),
                           "--save", str(tmp_path / "drift")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layers.0.input_norm.weight across tensor-parallel " \
        "ranks: 4 copies that must be equal differ by up to 0.4" in err, err
    assert not os.path.exists(tmp_path / "drift" / "model.safetensors")


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    from tests.helpers import TINY
    from tests.hf_models import hf_gpt2
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.checkpoint.format import CheckpointError, latest_checkpoint, read_meta
    from megazoo.training.checkpoint.hf import ConversionError, import_hf, read_hf_weights
    from megazoo.training.run.loop import build_chunks
    from megazoo.training.checkpoint.resume import load
    from megazoo.models.registry import build_model as model_provider
    from megazoo.parallel.random import model_parallel_seed
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.parallel.zero.optimizer import build_optimizer

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "mz")
    hf_gpt2(hf_dir)
    assert convert_hf_tool("import", "--hf-dir", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "1") == 0
    assert read_meta(latest_checkpoint(ckpt))["layout"]["vpp"] == 2

    def run_load(*extra):
        run = to_run_config(build_parser().parse_args(TINY + ["--train-iters", "1", "--load", ckpt,
                                                              *extra]), world_size=1)
        topo = ParallelTopology.single()
        chunks = build_chunks(model_provider, run, topo, model_parallel_seed(run.seed, topo))
        return load(run, topo, chunks, build_optimizer(chunks, topo, run.optimizer), None)

    assert run_load("--finetune").iteration == 0  # (tp2, pp2, vpp2) import -> tp1 run
    with pytest.raises(CheckpointError, match="holds weights only .*add --finetune"):
        run_load()
    with pytest.raises(CheckpointError, match="holds another model: hidden_size=32 there, 64 here"):
        run_load("--finetune", "--hidden-size", "64")

    # A truncated rank file names itself.
    rank1 = os.path.join(ckpt, "iter_0000000", "rank_00001.safetensors")
    with open(rank1, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointError, match="rank_00001.safetensors: corrupt or truncated"):
        run_load("--finetune")
    assert convert_hf_tool("export", "--load", ckpt, "--save", str(tmp_path / "out")) == 1
    assert "rank_00001.safetensors: corrupt or truncated" in capsys.readouterr().err

    # Hugging Face folders: another architecture, a missing config, a pickle that is not weights,
    # a truncated weights file.
    other = tmp_path / "t5"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConversionError, match="model_type 't5' is not supported; convert one of"):
        import_hf(str(other), str(tmp_path / "x"))
    with pytest.raises(ConversionError, match="config.json is missing"):
        import_hf(str(tmp_path), str(tmp_path / "x"))
    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"w": torch.ones(1), "obj": _NotAWeight()}, evil / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="pytorch_model.bin: corrupt, truncated or not a weights"):
        read_hf_weights(str(evil))
    weights = os.path.join(hf_dir, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ConversionError, match="model.safetensors: corrupt, truncated"):
        import_hf(hf_dir, str(tmp_path / "x"))


class _NotAWeight:
    """An arbitrary object: torch.load(weights_only=True) must refuse to build it."""

    def __reduce__(self):
        return (os.getcwd, ())
