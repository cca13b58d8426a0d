"""Llama under tensor, sequence and pipeline parallelism, in one 4-rank gloo world, against HF.

Weights come from random HF `LlamaForCausalLM` models (converted once per rank). For each model
(GQA with 2 KV heads, untied, llama3 rope; MQA, tied, linear rope) and tp in {1, 2, 4} with and
without sequence parallelism (tp = 4 > KV heads replicates them), and for pp = 2 (1F1B; and
interleaved with vpp = 2 x tp = 2 x SP; tied embeddings split over stages with replicated KV):
logits equal HF's, loss and every gradient equal the unsharded model's (fp32, 1e-5), replicated
KV rows hold equal gradients, gathering the shards gives back the loaded tensors exactly, and
KV-cache decoding under tp > 1 equals the full forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megazoo.models.llama import adapter as llama
from megazoo.models.llama.model import LlamaModel
from megazoo.models.blocks import KVCache
from megazoo.models.language_model import gather_logits
from megazoo.parallel.collectives import all_gather
from megazoo.parallel.pipeline.engine import run_pipeline
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from megazoo.parallel.tensor_parallel import tp_layout
from tests.distributed import sum_tied_embedding_grads
from megazoo.parallel.sharding import full_tensor, load_full_state_dict
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import run_distributed
from tests.hf_models import LLAMA3, VOCAB

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH = 8, 4
MODELS = {  # hf_llama keyword arguments
    "gqa2-untied-llama3": dict(hidden=64, heads=8, kv_heads=2, scaling=LLAMA3, layers=4),
    "mqa-tied-linear": dict(hidden=32, heads=4, kv_heads=1, tied=True, layers=4,
                            scaling={"rope_type": "linear", "factor": 2.0}),
}
# (model, schedule, pp, vpp, microbatches, tp, sequence_parallel)
PIPELINES = [
    ("gqa2-untied-llama3", "1f1b", 2, 1, 4, 1, False),
    ("gqa2-untied-llama3", "interleaved", 2, 2, 4, 2, True),
    ("mqa-tied-linear", "1f1b", 2, 1, 2, 2, False),  # tp 2 > 1 KV head, tied head on stage 2
]


def _batch():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _check_shards(chunks, topo, full, cfg, where):
    """Gathered parameters are the loaded tensors; replicated KV rows got equal gradients."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert torch.equal(full_tensor(p, topo), full[chunk.canonical_name(name)]), (where, name)
            layout = tp_layout(p)
            rows = layout.replicated_rows(topo.tp) if layout is not None else 0
            if rows:
                copies = all_gather(p.grad[-rows:], topo.tp_group).chunk(topo.tp)
                rep = topo.tp // cfg.num_query_groups
                for r in range(topo.tp):
                    torch.testing.assert_close(copies[r], copies[r - r % rep], rtol=0, atol=0,
                                               msg=f"{where} {name}: KV copies differ")


def hf_references() -> dict:
    """Per model: megazoo config, full tensors converted from HF, HF's logits and loss. Computed
    once in the test process, so the ranks need not import transformers (seconds each)."""
    from tests.hf_models import hf_llama
    ids, labels = _batch()
    out = {}
    for name, kw in MODELS.items():
        hf = hf_llama(**kw)
        cfg = llama.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
        with torch.no_grad():
            hf_logits = hf(ids).logits
        hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten())
        out[name] = (cfg, llama.from_hf_state_dict(hf.state_dict(), cfg), hf_logits, hf_loss)
    return out


def _worker(rank, hf_refs):
    torch.use_deterministic_algorithms(True)
    ids, labels = _batch()
    errors = {"logits_vs_hf": 0.0, "grads_vs_tp1": 0.0, "loss_vs_hf": 0.0}
    checked = []

    def err(kind, a, b):
        errors[kind] = max(errors[kind], (a - b).abs().max().item())

    refs = {}
    for name, (cfg, full, hf_logits, hf_loss) in hf_refs.items():
        single = ParallelTopology.single()
        ref = LlamaModel(cfg, single)
        load_full_state_dict(ref, full, single)
        ref(ids, labels=labels).mean().backward()
        ref_grads = {ref.canonical_name(n): full_tensor(p, single, p.grad) for n, p in ref.named_parameters()}
        refs[name] = (cfg, full, hf_logits, hf_loss, ref_grads)
        for tp in (1, 2, 4):
            for sp in ((False,) if tp == 1 else (False, True)):
                where = f"{name} tp={tp} sp={sp}"
                topo = ParallelTopology.from_config(ParallelConfig(tp=tp, sequence_parallel=sp))
                model = LlamaModel(cfg, topo)
                load_full_state_dict(model, full, topo)
                logits = gather_logits(model(ids), topo, cfg.vocab_size)
                loss = model(ids, labels=labels).mean()
                loss.backward()
                torch.testing.assert_close(logits, hf_logits, **TOL, msg=where)
                torch.testing.assert_close(loss, hf_loss, **TOL, msg=where)
                err("logits_vs_hf", logits, hf_logits), err("loss_vs_hf", loss, hf_loss)
                for n, p in model.named_parameters():
                    g = full_tensor(p, topo, p.grad)
                    torch.testing.assert_close(g, ref_grads[model.canonical_name(n)], **TOL,
                                               msg=lambda m: f"{where} grad {n}: {m}")
                    err("grads_vs_tp1", g, ref_grads[model.canonical_name(n)])
                _check_shards([model], topo, full, cfg, where)
                if tp > 1 and not sp:  # incremental decoding with this rank's (maybe copied) KV heads
                    cache = KVCache()
                    with torch.no_grad():
                        steps = [model(ids[:, :3], cache=cache)] + [model(ids[:, i:i + 1], cache=cache)
                                                                    for i in range(3, SEQ)]
                    decoded = gather_logits(torch.cat(steps, 1), topo, cfg.vocab_size)
                    torch.testing.assert_close(decoded, logits, **TOL, msg=f"{where} KV cache")
                checked.append(where)

    for name, schedule, pp, vpp, m, tp, sp in PIPELINES:
        cfg, full, hf_logits, hf_loss, ref_grads = refs[name]
        where = f"{name} {schedule} pp={pp} vpp={vpp} tp={tp} sp={sp}"
        topo = ParallelTopology.from_config(ParallelConfig(tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp))
        chunks = [LlamaModel(cfg, topo, **spec.kwargs())
                  for spec in partition(cfg.num_layers, pp, vpp)[topo.pp_rank]]
        for chunk in chunks:
            load_full_state_dict(chunk, full, topo)
        broadcast_tied_embedding(chunks, topo)
        mbs = [{"tokens": t, "labels": y, "index": i}
               for i, (t, y) in enumerate(zip(ids.chunk(m), labels.chunk(m)))]
        captured = {}

        def forward_fn(chunk, inp, mb):
            x = mb["tokens"] if inp is None else inp
            if not chunk.post_process:
                return chunk(x)
            with torch.no_grad():
                captured[mb["index"]] = gather_logits(chunk(x), topo, cfg.vocab_size)
            return chunk(x, labels=mb["labels"]).mean()

        shape = (SEQ // tp if sp else SEQ, BATCH // m, cfg.hidden_size)
        losses = run_pipeline(build_schedule(schedule, pp, topo.pp_rank, m, vpp), chunks, mbs, topo,
                              shape, torch.float32, forward_fn)
        sum_tied_embedding_grads(chunks, topo)
        assert bool(losses) == topo.is_last_stage, (where, losses)
        if losses:  # last stage
            logits = torch.cat([captured[i] for i in range(m)])
            torch.testing.assert_close(logits, hf_logits, **TOL, msg=where)
            torch.testing.assert_close(torch.stack(losses).mean(), hf_loss, **TOL, msg=where)
            err("logits_vs_hf", logits, hf_logits)
        for chunk in chunks:
            for n, p in chunk.named_parameters():
                g = full_tensor(p, topo, p.grad)
                torch.testing.assert_close(g, ref_grads[chunk.canonical_name(n)], **TOL,
                                           msg=lambda msg: f"{where} grad {n}: {msg}")
                err("grads_vs_tp1", g, ref_grads[chunk.canonical_name(n)])
        _check_shards(chunks, topo, full, cfg, where)
        checked.append(where)
    return checked, errors


def test_llama_tensor_and_pipeline_parallel_match_hf_and_tp1():
    results = run_distributed(_worker, 4, hf_references(), timeout=300)
    checked, errors = results[0]
    assert len(checked) == 2 * 5 + len(PIPELINES)
    print("max abs errors over ranks:", {k: max(r[1][k] for r in results) for k in errors})
