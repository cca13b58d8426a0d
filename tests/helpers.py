"""Helpers shared by the test modules (no test module imports from another one).

Constants and builders for small models, in-process training runs, the ZeRO tests' plain
data-parallel reference, pipeline-engine pieces, Hugging Face references and the tools/ scripts.
Spawned test ranks import this module, so transformers, tokenizers and the training stack are
imported inside the functions that need them. `tests/distributed.py` (spawned gloo worlds) and
`tests/tolerances.py` (the numeric tolerances) stay where they are.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from models.config import TransformerConfig
from models.language_model import TransformerLanguageModel
from parallel import collectives as C
from parallel.sharding import full_tensor
from parallel.topology import ParallelConfig, ParallelTopology
from parallel.zero import OptimizerConfig, build_optimizer
from parallel.zero.muon import MuonSettings, newton_schulz, uses_muon
from tests.distributed import run_distributed
from tests.fixtures import GPT2

ROOT = Path(__file__).resolve().parents[1]  # the repository
REPO = str(ROOT)
VOCAB = 101  # the HF reference models' vocabulary (padded under TP)


# ---- In-process training runs ----------------------------------------------------------------


TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "1000", "--seed", "5"]


def pretrain_gpt(argv, world):
    from train_gpt import model_provider
    from training.config.flags import to_run_config
    from training.config.parser import build_parser
    from training.run.loop import pretrain
    run = to_run_config(build_parser().parse_args(argv), world_size=world)
    return pretrain(model_provider, run)


@pytest.fixture(autouse=True)
def one_thread():
    """In-process runs of a tiny model: threads only add contention (autouse where imported)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def record_hang_start(run_dir: str) -> None:
    """Called by the worker at the moment its fault begins: the reference for the watchdog's delay."""
    with open(os.path.join(run_dir, "hang_start"), "w") as f:
        f.write(repr(time.time()))


def hang_detail(worker, run_dir) -> str:
    """Run a 2-rank world in which rank 1 hangs (recording when, `record_hang_start`); rank 0's
    watchdog must end it within 40 s of the hang's start (a 3 s timeout: the bound is for load, not
    for the watchdog): its message."""
    from training.monitor.journal import read_jsonl
    with pytest.raises(RuntimeError, match=r"ranks \[0\] died"):
        run_distributed(worker, 2, str(run_dir), timeout=120)
    hangs = [e for e in read_jsonl(os.path.join(run_dir, "journal.jsonl")) if e["kind"] == "hang"]
    assert hangs and hangs[0]["rank"] == 0, hangs
    with open(os.path.join(run_dir, "hang_start")) as f:
        started = float(f.read())
    assert hangs[0]["time"] - started < 40, (started, hangs[0]["time"])
    return hangs[0]["detail"]


# ---- Pipeline engine runs --------------------------------------------------------------------


def mean_loss_forward(chunk, inp, mb):
    """forward_fn for the engine: the microbatch's mean token loss on the last stage."""
    out = chunk(mb["tokens"] if inp is None else inp,
                labels=mb["labels"] if chunk.post_process else None)
    return out.mean() if chunk.post_process else out


def microbatches(tokens, labels, m: int, dp_topo=None) -> list[dict]:
    """Split the global batch into m microbatches; with `dp_topo`, this DP rank's share only."""
    if dp_topo is not None:
        tokens = tokens.chunk(dp_topo.dp)[dp_topo.dp_rank]
        labels = labels.chunk(dp_topo.dp)[dp_topo.dp_rank]
    return [{"tokens": t, "labels": y} for t, y in zip(tokens.chunk(m), labels.chunk(m))]


def data_parallel_mean(tensors, topo) -> None:
    """What the data-parallel optimizer will do (not the pipeline's job): average over replicas."""
    for t in tensors:
        C.all_reduce(t, topo.dp_group)
        t /= topo.dp


# ---- The ZeRO tests' small GPT, its data, the plain data-parallel reference and a ZeRO run ----


GLOBAL_BATCH, SEQ, STEPS = 8, 8, 3
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, clip_grad=0.5)


def small_gpt(**kw) -> TransformerConfig:
    base = dict(vocab_size=101, hidden_size=48, num_layers=2, num_attention_heads=4,
                ffn_hidden_size=96, max_position_embeddings=16, make_vocab_size_divisible_by=8,
                seed=7)
    return TransformerConfig(**{**base, **kw})


def batch(step: int, topo: ParallelTopology | None = None):
    """Step `step`'s global batch, or this DP rank's share of it."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 101, (GLOBAL_BATCH, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if topo is not None and topo.dp > 1:
        ids, labels = ids.chunk(topo.dp)[topo.dp_rank], labels.chunk(topo.dp)[topo.dp_rank]
    return ids, labels


def dp_mean(value: float, topo) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    C.all_reduce(t, topo.dp_group)
    return t.item() / topo.dp


def reference_run(topo: ParallelTopology, cfg: TransformerConfig, steps: int = STEPS):
    """Plain DP with torch.optim.AdamW: (per-step mean losses, full parameters, grad norms)."""
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2],
                              "weight_decay": HYPER["weight_decay"]},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    losses, norms = [], []
    for step in range(steps):
        ids, labels = batch(step, topo)
        loss = model(ids, labels=labels).mean()
        loss.backward()
        for _, p in named:
            C.all_reduce(p.grad, topo.dp_group)
            p.grad /= topo.dp
        params = [p for _, p in named]
        norms.append(torch.nn.utils.clip_grad_norm_(params, HYPER["clip_grad"]).item()
                     if HYPER["clip_grad"] > 0 else
                     torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        opt.step()
        opt.zero_grad()
        losses.append(dp_mean(loss.item(), topo))
    single = ParallelTopology.single()
    return losses, {n: full_tensor(p, single).clone() for n, p in named}, norms


def initial_parameters(cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full parameters before training (weights are seeded by name: the same for every layout)."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(cfg, single)
    return {n: full_tensor(p, single).detach().clone() for n, p in model.named_parameters()}


def opt_config(**kw) -> OptimizerConfig:
    return OptimizerConfig(**{**HYPER, **kw})


def zero_run(topo: ParallelTopology, cfg: TransformerConfig, ocfg: OptimizerConfig,
             steps: int = STEPS, microbatches: int = 1, inject_inf_at: tuple[int, ...] = (),
             on_step=None):
    """Train with the ZeRO optimizer: (losses, full fp32 parameters, StepResults, optimizer)."""
    model = TransformerLanguageModel(cfg, topo)
    opt = build_optimizer(model, topo, ocfg)
    losses, results = [], []
    for step in range(steps):
        ids, labels = batch(step, topo)
        total = 0.0
        for m, (i, y) in enumerate(zip(ids.chunk(microbatches), labels.chunk(microbatches))):
            last = m == microbatches - 1
            with (opt.no_sync() if not last else _null()):
                loss = model(i, labels=y).float().mean()
                if step in inject_inf_at and last:
                    loss = loss * float("inf")  # an fp16 overflow: every gradient becomes inf/NaN
                opt.backward(loss / microbatches)
            total += loss.item() / microbatches
        results.append(opt.step())
        opt.zero_grad()
        losses.append(dp_mean(total, topo))
        if on_step is not None:
            on_step(step, model, opt)
    return losses, full_model_parameters(model, opt, topo), results, opt


def full_model_parameters(model, opt, topo) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 parameter (DP-gathered by the optimizer, TP-gathered here)."""
    dp_full = opt.full_parameters()
    return {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
            for n, p in model.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def topology(**kw) -> ParallelTopology:
    return ParallelTopology.from_config(ParallelConfig(**kw))


# ---- Models ----------------------------------------------------------------------------------


def moe_config(**kw) -> TransformerConfig:
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                bias=False, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    return TransformerConfig(**{**base, **kw})


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}  # short: all three frequency bands occur


def hf_llama(heads=6, kv_heads=2, tied=False, scaling=None, theta=500.0, layers=2, seed=0, hidden=48,
             bias=False):
    """A random HF Llama; every tensor perturbed (HF inits norms to 1, which would hide mistakes)."""
    # imported here: spawned test ranks import this module's constants, and transformers costs
    # seconds per process
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=80,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta},
                         attention_bias=bias, mlp_bias=bias,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return perturbed(LlamaForCausalLM(config), seed + 1)


def perturbed(model, seed: int = 0):
    """`model` in eval mode with every tensor moved by N(0, 0.05) noise (HF inits biases to 0 and
    norms to 1, which would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def hf_gpt2(folder, bloom=False):
    """A random GPT-2 (or BLOOM) with TINY's shape, and transformers' loss on the first mock
    batch."""
    from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

    from training.run.batches import MockGPTDataset
    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=61, hidden_size=32, n_layer=4, n_head=4)) if bloom \
        else GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=4,
                                        n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    hf.eval().save_pretrained(folder)
    data = MockGPTDataset(2 * 8, 16, 61, seed=5)  # train_iters x global batch, TINY's --seed
    tokens = torch.stack([torch.from_numpy(data[i]["tokens"]) for i in range(8)])
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


# ---- Tools and Hugging Face references -------------------------------------------------------


def tool_module(name):
    """A tools/ script as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, f"tools/{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert_hf_tool(*argv):
    return tool_module("convert_hf").main(list(argv))


def generate_tool(argv):
    """tools/generate.py's main in this (spawned) process; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tool_module("generate").main(argv) == 0
    return out.getvalue().strip()


def save_word_tokenizer(folder):
    """A word-level tokenizer.json over the 101-token vocabulary (w0..w99, <|endoftext|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<|endoftext|>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return tok


def pipeline_logits(chunks, topo, ids, hidden):
    """Forward through the virtual stages in model order (stage s: rank s % pp, chunk s // pp)."""
    import torch.distributed as dist

    from models.language_model import gather_logits
    h, last = None, topo.pp * topo.vpp - 1
    for s in range(last + 1):
        if topo.pp_rank != s % topo.pp:
            continue
        if s > 0:
            h = torch.empty(ids.shape[1], ids.shape[0], hidden)
            dist.recv(h, topo.stage_rank(topo.pp_rank - 1))
        out = chunks[s // topo.pp](ids if s == 0 else h)
        if s < last:
            dist.send(out.contiguous(), topo.stage_rank(topo.pp_rank + 1))
        else:
            return gather_logits(out, topo, chunks[-1].config.vocab_size)
    return None


def hf_reference(hf, ids, prompt, new_tokens: int) -> dict:
    """transformers' logits on `ids` and greedy generation from `prompt`, with an eos id chosen so
    that row 0 stops after 3 tokens (the padding path): the keys `check_against_hf` reads."""
    with torch.no_grad():
        logits = hf(ids).logits
        free = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        eos = int(free[0, prompt.shape[1] + 2])
        greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos)
    return dict(ids=ids, prompt=prompt, logits=logits, eos=eos, greedy=greedy)


def check_against_hf(case: dict, topo, new_tokens: int):
    """Load `case["ckpt"]` under `topo`: logits within 1e-5 of `case["logits"]` (last stage) and,
    with pp = 1, greedy generation equal to `case["greedy"]` (eos `case["eos"]`). Returns this
    rank's chunks and its max logit error (0.0 off the last stage)."""
    from models.generation import SamplingConfig, generate
    from training.checkpoint.format import latest_checkpoint
    from training.checkpoint.hf import load_model_chunks
    config, chunks = load_model_chunks(latest_checkpoint(case["ckpt"]), topo)
    where = f"{case.get('name', case.get('family'))} at tp={topo.tp} pp={topo.pp} vpp={topo.vpp}"
    with torch.no_grad():
        logits = pipeline_logits(chunks, topo, case["ids"], config.hidden_size)
    error = 0.0
    if logits is not None:
        torch.testing.assert_close(logits, case["logits"], rtol=0, atol=1e-5, msg=where)
        error = (logits - case["logits"]).abs().max().item()
    if topo.pp == 1:
        out = generate(chunks[0], topo, case["prompt"], new_tokens, SamplingConfig(eos_id=case["eos"]))
        assert torch.equal(out, case["greedy"]), (where, out, case["greedy"])
    return chunks, error


NEW_TOKENS = 6


def round_trip_cases(supported: dict, tmp_path, ids, prompt) -> tuple[list[dict], list]:
    """Each `name: (builder, non-default fields)` of `supported` as a random (perturbed) HF model,
    saved, imported and exported: the export's tensors equal HF's bit for bit, transformers reloads
    it as the same class with the fields read back and HF's exact logits. Returns the cases
    (`hf_reference`'s keys, the checkpoint, family, full tensors, config) and the HF models."""
    from transformers import AutoModelForCausalLM

    from training.checkpoint.hf import export_hf, hf_to_full, import_hf
    cases, models = [], []
    for i, (name, (build, fields)) in enumerate(sorted(supported.items())):
        torch.manual_seed(i)
        hf = perturbed(build(**fields), seed=i)
        hf_dir, ckpt, out = (str(tmp_path / f"{k}_{name}") for k in ("hf", "mz", "back"))
        hf.save_pretrained(hf_dir)
        ref = hf_reference(hf, ids, prompt, NEW_TOKENS)
        import_hf(hf_dir, ckpt)
        export_hf(ckpt, out)
        back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        assert type(back) is type(hf), name
        assert back.config.architectures == [type(hf).__name__]
        for field, value in fields.items():  # written back, read back the same
            assert getattr(back.config, field) == value, (name, field)
        ref_sd, back_sd = hf.state_dict(), back.state_dict()
        assert ref_sd.keys() == back_sd.keys(), name
        for k in ref_sd:
            assert torch.equal(ref_sd[k], back_sd[k]), (name, k)
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, ref["logits"], rtol=0, atol=0)
        model_type, config, full = hf_to_full(hf_dir)
        cases.append(dict(ref, name=name, ckpt=ckpt, hf_dir=hf_dir, out=out, family=model_type,
                          full=full.weights, config=config.replace(make_vocab_size_divisible_by=8)))
        models.append(hf)
    return cases, models


# ---- Data tools ------------------------------------------------------------------------------


def load_tool(name):
    """Import tools/<name>.py (not a package); registered so dataclasses and pickling (fork) work."""
    if f"tool_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"tool_{name}"]


def preprocess(*args, ok=True, subprocess_run=False):
    """Run the tool in this process (fast: no interpreter start), or as the real script."""
    argv = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(GPT2 / "vocab.json"),
            "--merge-file", str(GPT2 / "merges.txt"), "--no-progress", *map(str, args)]
    if subprocess_run:
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *argv],
                              capture_output=True, text=True, timeout=120)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = load_tool("preprocess_data").main(argv)
        out = buf.getvalue()
    assert (rc == 0) == ok, out
    return out


def read_docs(prefix):
    from data.indexed import IndexedDataset
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))], ds


def write_jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))


CHAT = ["<|im_start|>", "<|im_end|>"]


TOKENIZER_TEXTS = ["Hello world! <|endoftext|> naïve café 123 4567\n\n  spaces\tand tabs",
         "I'm here, don't you ALL'S", "日本語のテキスト 🤖 emoji",
         "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"]


def bpe_files(tmp_path) -> tuple[str, str]:
    """GPT-2's vocab.json + merges.txt (the repository's fixture), else a byte-level BPE trained
    here with the tokenizers library."""
    for folder in (os.path.join(REPO, "tests", "fixtures", "gpt2"), "/work/shared/data/tokenizers/gpt2"):
        vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
        if os.path.isfile(vocab) and os.path.isfile(merges):
            return vocab, merges
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TOKENIZER_TEXTS * 50 + ["the quick brown fox jumps over the lazy dog"] * 50,
                            vocab_size=400, special_tokens=["<|endoftext|>"])
    out = tmp_path / "trained"
    out.mkdir()
    return tuple(bpe.save_model(str(out)))


def tokenizer_folders(tmp_path, kind: str, old_config: bool):
    """(folder with tokenizer.json, folder with vocab.json + merges.txt + tokenizer_config.json,
    the transformers tokenizer)."""
    from transformers import GPT2Tokenizer, Qwen2Tokenizer
    vocab, merges = bpe_files(tmp_path)
    if kind == "gpt2":
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    else:
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": CHAT})
    full, mini = tmp_path / f"{kind}_full", tmp_path / f"{kind}_mini"
    tok.save_pretrained(full)
    mini.mkdir()
    shutil.copy(vocab, mini / "vocab.json")
    shutil.copy(merges, mini / "merges.txt")
    config = json.loads((full / "tokenizer_config.json").read_text())
    if old_config:  # transformers 4.x writes the added tokens with their ids
        for key in ("extra_special_tokens", "additional_special_tokens"):
            config.pop(key, None)
        config["added_tokens_decoder"] = {
            str(tok.convert_tokens_to_ids(t)): dict(content=t, lstrip=False, rstrip=False,
                                                    normalized=False, single_word=False, special=True)
            for t in CHAT}
    (mini / "tokenizer_config.json").write_text(json.dumps(config))
    return str(full), str(mini), tok


def hf_converted(hf, adapter, topo=None):
    """(config, megazoo model in eval mode) holding a transformers model's weights, through the
    family's HF adapter (`models.<family>`), vocabulary padded to a multiple of 8."""
    from models.registry import build_model
    from parallel.sharding import load_full_state_dict
    from parallel.topology import ParallelTopology
    cfg = adapter.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    topo = topo or ParallelTopology.single()
    model = build_model(cfg, topo).eval()
    load_full_state_dict(model, adapter.from_hf_state_dict(hf.state_dict(), cfg), topo)
    return cfg, model


# ---- Muon: torch.optim.Muon + AdamW as the single-process reference, and megazoo's run ------
# (tests/parallel/test_optim_muon.py and the QK-clip / context-parallel Muon tests)


MUON_STEPS, MUON_BATCH, MUON_SEQ = 5, 8, 8
MUON_LR, MUON_WD, MUON_CLIP, MUON_BETAS, MUON_EPS = 1e-2, 0.1, 0.5, (0.9, 0.95), 1e-6
MUON_FP32 = MuonSettings(momentum=0.95, nesterov=True, ns_dtype="fp32", scale_mode="spectral",
                         extra_scale_factor=0.2)


def muon_gpt_config() -> TransformerConfig:
    return TransformerConfig(vocab_size=101, hidden_size=48, num_layers=2, num_attention_heads=4,
                             ffn_hidden_size=96, max_position_embeddings=16,
                             make_vocab_size_divisible_by=8, seed=7)


def muon_moe_config() -> TransformerConfig:
    return TransformerConfig(vocab_size=101, hidden_size=32, num_layers=2, num_attention_heads=4,
                             normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                             bias=False, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
                             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, seed=11)


def muon_opt_config(**kw) -> OptimizerConfig:
    return OptimizerConfig(**{**dict(optimizer="muon", lr=MUON_LR, betas=MUON_BETAS,
                                     eps=MUON_EPS, weight_decay=MUON_WD, clip_grad=MUON_CLIP,
                                     muon=MUON_FP32), **kw})


def muon_batch(step: int, topo=None):
    """(inputs, labels) of step `step`: the whole batch, or this data-parallel rank's share (of
    the samples) and context-parallel rank's share (of each sequence)."""
    from parallel.context_parallel import split_sequence
    tokens = torch.randint(0, 101, (MUON_BATCH, MUON_SEQ + 1),
                           generator=torch.Generator().manual_seed(100 + step))
    if topo is not None and topo.dp > 1:
        tokens = tokens.chunk(topo.dp)[topo.dp_rank]
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if topo is not None and topo.cp > 1:
        ids, labels = (split_sequence(t, 1, topo.cp, topo.cp_rank) for t in (ids, labels))
    return ids, labels


@functools.lru_cache(maxsize=None)  # computed once in the test process, handed to the workers
def muon_reference(config=muon_gpt_config):
    """(initial, trained) full parameters with torch.optim.Muon + AdamW on the whole batch. An
    expert weight [experts, out, in] is stepped as one 2-D torch.optim.Muon parameter per expert."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(config(), single)
    named = list(model.named_parameters())
    init = {n: full_tensor(p, single).clone() for n, p in named}  # vocabulary padding trimmed
    chosen = [p for n, p in named if uses_muon(n, p, MUON_FP32)]
    experts = {id(p): [torch.nn.Parameter(e.detach().clone()) for e in p] for p in chosen
               if p.dim() == 3}
    muon = [p for p in chosen if p.dim() == 2] + [e for es in experts.values() for e in es]
    ids = {id(p) for p in chosen}
    rest = [p for _, p in named if id(p) not in ids]
    opts = [torch.optim.Muon(muon, lr=MUON_LR, weight_decay=MUON_WD, momentum=MUON_FP32.momentum,
                             nesterov=MUON_FP32.nesterov, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2],
                                "weight_decay": MUON_WD},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=MUON_LR, betas=MUON_BETAS, eps=MUON_EPS)]
    fp32_ns = lambda g, coefficients, steps, eps: newton_schulz(g, coefficients, steps,  # noqa
                                                                torch.float32)
    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", fp32_ns):
        for step in range(MUON_STEPS):
            ids, labels = muon_batch(step)
            model(ids, labels=labels).mean().backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in named], MUON_CLIP)
            for p in chosen:
                for e, shadow in enumerate(experts.get(id(p), [])):
                    shadow.grad = p.grad[e].clone()
            for o in opts:
                o.step()
                o.zero_grad()
            with torch.no_grad():
                for p in chosen:
                    p.grad = None
                    for e, shadow in enumerate(experts.get(id(p), [])):
                        p[e].copy_(shadow)
    return init, {n: full_tensor(p, single).clone() for n, p in named}, len(muon)


def muon_train(topo, ocfg, steps=MUON_STEPS, model=None, opt=None, config=muon_gpt_config):
    model = model or TransformerLanguageModel(config(), topo)
    opt = opt or build_optimizer(model, topo, ocfg)
    start = opt.iteration  # a resumed run continues with the next batches
    for step in range(start, start + steps):
        ids, labels = muon_batch(step, topo)
        opt.backward(model(ids, labels=labels).mean())
        assert not opt.step().skipped
        opt.zero_grad()
    return model, opt


def muon_full_parameters(model, opt, topo):
    dp_full = opt.full_parameters()
    return {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
            for n, p in model.named_parameters()}
