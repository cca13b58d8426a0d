"""Qwen3.5, Qwen3-Next, Qwen3.5-MoE and Nemotron-H (the hybrid families: Gated DeltaNet / Mamba-2
layers beside attention, docs/hybrid.md) through megazoo's registry, adapters and real trainer.

- In process: each family's adapter against transformers (random tiny models: logits within
  1e-5, greedy generation equal, tensors and config back bit-identical, a saved folder through
  the real import path; Qwen3-Next's and Qwen3.5-MoE's imported aux-loss coefficient against
  transformers' load-balancing loss) and its published presets equal to what the importer makes
  of transformers' config fields.
- One 2-rank world: the trainer (training/run/loop.py, what train_*.py runs) on each family's
  tiny preset under tp2 + sequence parallelism, pp2 (each stage holds two layer kinds), cp2
  (linear layers by heads, attention by the ring), dp2 with ZeRO-3, and ep2 for
  Qwen3-Next's experts, and Nemotron-H with MoE layers and Qwen3.5-MoE at ep2 and tp2 + SP:
  every iteration's loss equal to the unsharded run's (1e-5). Then a
  Qwen3.5 checkpoint written at tp2 + SP resumes at pp2 and continues the unsharded curve.
  Uneven stages from Megatron-core's --pipeline-model-parallel-layout: Nemotron-H (one Mamba-2
  layer on the first stage, the attention, Mamba-2 and MLP layers on the last) and a dense Qwen3
  equal the unsharded run; the Nemotron-H checkpoint at that layout, resharded offline to pp1 x
  dp2 (tools/reshard.py), continues the curve. And
  packed documents at cp2, model level: loss and every gradient equal the unsharded model's,
  for the presets (linear layers by heads) and for variants with 3 heads (the state-passing
  chain); the path each layer took is the one the planner assumes.
- One 4-rank world: the trainer at cp4 for each family (linear layers by heads, Qwen's key heads
  and Nemotron-H's groups repeated over pairs of ranks), Qwen3-Next at tp2 + SP + cp2 and
  Nemotron-H at pp2 + cp2, and packed documents at cp4 (by heads, and the chain variants).
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from tests.distributed import all_reduce_each, run_distributed
from tests.helpers import one_thread  # noqa: F401 - autouse

TOL = dict(rtol=1e-5, atol=1e-5)
PRESETS = ("qwen3.5-tiny", "qwen3-next-tiny", "nemotron-h-tiny")
ARGV = ["--seq-length", "32", "--mock-data", "--log-interval", "100", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "1e-2", "--lr-decay-style", "constant", "--seed", "3",
        "--train-iters", "3"]
LAYOUTS_2 = {"tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
             "pp2": ["--pipeline-model-parallel-size", "2"],
             "cp2": ["--context-parallel-size", "2"],
             "dp2 zero3": ["--zero-stage", "3", "--use-distributed-optimizer"]}
EP2 = {"qwen3-next-tiny": ["--expert-model-parallel-size", "2"]}
# Nemotron-H with MoE layers beside dense ones (unsharded reference too): ep2, tp2 + SP
# and Qwen3.5-MoE (every MLP sparse, a gated shared expert split over TP)
MOE_2 = {"nemotron-h-moe-tiny": {"ep2": ["--expert-model-parallel-size", "2"],
                                 "tp2 sp": LAYOUTS_2["tp2 sp"]},
         "qwen3.5-moe-tiny": {"ep2": ["--expert-model-parallel-size", "2"],
                              "tp2 sp": LAYOUTS_2["tp2 sp"]}}
# cp with tp + SP (the mixers' sequence gather before the state chain), cp with pp
COMBINED = {"qwen3-next-tiny": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--context-parallel-size", "2"],
            "nemotron-h-tiny": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]}
# uneven pipeline stages (Megatron-core's layout string): a hybrid and a dense model
UNEVEN = {"nemotron-h-tiny": "Et|t*3L", "qwen3-tiny": "Et*3|tL"}
# packed documents, model level: the presets' linear layers split by heads at cp2 and cp4 (cp4:
# Qwen's 2 key heads and Nemotron-H's 2 groups repeated); these variants' heads (3) do not
# divide, so their linear layers keep the state-passing chain
CHAIN = {"qwen3.5-tiny chain": ("qwen3.5-tiny", dict(linear_num_key_heads=1,
                                                     linear_num_value_heads=3)),
         "nemotron-h-tiny chain": ("nemotron-h-tiny", dict(mamba_num_heads=3, mamba_groups=1))}
SEQ, BATCH = 32, 2


def _train(argv: list[str], world: int) -> list[float]:
    from megazoo.models.registry import build_model
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    return pretrain(build_model, to_run_config(build_parser().parse_args(ARGV + argv),
                                               world_size=world)).losses


def _packed_references() -> dict:
    """Per preset: full weights, packed rows (a document starting inside a chunk, one at a
    context rank's first token, a one-token document) and the unsharded loss and gradients."""
    from megazoo.data.packing import positions_in_documents
    from megazoo.models.presets import preset
    from megazoo.models.registry import build_model
    from megazoo.parallel.context_split import Documents
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    docs = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, starts in enumerate(((5, 8, 9, 21), (4, 16, 27))):
        for s in starts:
            docs[row, s:] += 1
    topo = ParallelTopology.from_config(ParallelConfig())
    out = {}
    configs = {name: preset(name) for name in PRESETS}
    configs.update({name: preset(base).replace(**fields) for name, (base, fields) in CHAIN.items()})
    for name, config in configs.items():
        torch.manual_seed(0)
        model = build_model(config, topo)
        with torch.no_grad():  # move the norms and decays off their initial values
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        loss = model(ids, labels=labels, documents=Documents(docs, positions_in_documents(docs)))
        loss.mean().backward()
        out[name] = (config, {model.canonical_name(n): p.detach().clone()
                              for n, p in model.named_parameters()},
                     loss.detach().mean(), {model.canonical_name(n): p.grad.clone()
                                            for n, p in model.named_parameters()})
    return out, ids, labels, docs


def _packed(refs, ids, labels, docs, cp: int) -> list[str]:
    """Packed documents at context-parallel size `cp` (this world's size): loss and gradients."""
    from megazoo.data.packing import positions_in_documents
    from megazoo.models.hybrid_shapes import describe
    from megazoo.models.registry import build_model
    from megazoo.parallel.context_split import Documents, split_sequence
    from megazoo.parallel.sharding import full_tensor, load_full_state_dict
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.training.planning.hybrid import by_heads
    topo = ParallelTopology.from_config(ParallelConfig(cp=cp))
    local = lambda t: split_sequence(t, 1, cp, topo.cp_rank)  # noqa: E731
    checked = []
    for name, (config, full, ref_loss, ref_grads) in refs.items():
        model = build_model(config, topo)
        load_full_state_dict(model, full, topo)
        # by heads, or the chain; the planner's rule says the same
        paths = {m.by_heads for m in model.modules() if hasattr(m, "by_heads")}
        planned = {by_heads(layer.mixer, 1, cp) for layer in describe(config).layers
                   if layer.kind in ("gated_deltanet", "mamba2")}
        assert paths == planned == {name not in CHAIN}, (name, cp, paths, planned)
        documents = Documents(docs, local(positions_in_documents(docs)))
        loss = model(local(ids), labels=local(labels), documents=documents).mean()
        loss.backward()
        loss = loss.detach()
        reduced = [loss] + [p.grad for p in model.parameters()]
        all_reduce_each(reduced, topo.cp_group)
        for t in reduced:
            t.div_(cp)
        where = f"{name} cp{cp} packed"
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=where)
        for pname, p in model.named_parameters():
            torch.testing.assert_close(full_tensor(p, topo, p.grad),
                                       ref_grads[model.canonical_name(pname)], **TOL,
                                       msg=lambda m: f"{where} grad {pname}: {m}")
        checked.append(where)
    return checked


def _world2(rank, packed, run_dir):
    losses = {}
    for name in PRESETS:
        for layout, flags in {**LAYOUTS_2, **({"ep2": EP2[name]} if name in EP2 else {})}.items():
            losses[f"{name} {layout}"] = _train(["--model", name] + flags, 2)
    for name, layouts in MOE_2.items():
        for layout, flags in layouts.items():
            losses[f"{name} {layout}"] = _train(["--model", name] + flags, 2)
    # a checkpoint written at tp2 + SP after 2 iterations, resumed at pp2 for the third
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _train(["--model", "qwen3.5-tiny", "--train-iters", "2", "--save", run_dir,
            "--save-interval", "2"] + tp, 2)
    losses["qwen3.5-tiny tp2 sp -> pp2 resume"] = _train(
        ["--model", "qwen3.5-tiny", "--load", run_dir, "--pipeline-model-parallel-size", "2"], 2)
    _uneven(rank, losses, run_dir + "-uneven")
    return losses, _packed(*packed, cp=2)


def _uneven(rank, losses, run_dir):
    import torch.distributed as dist

    from megazoo.tools.reshard import reshard
    name, layout = "qwen3-tiny", UNEVEN["qwen3-tiny"]
    losses[f"{name} pp2 layout {layout}"] = _train(
        ["--model", name, "--pipeline-model-parallel-size", "2",
         "--pipeline-model-parallel-layout", layout], 2)
    # Nemotron-H: two iterations at the layout, saved, resharded, the third at pp1 x dp2
    name, layout = "nemotron-h-tiny", UNEVEN["nemotron-h-tiny"]
    losses[f"{name} pp2 layout saved"] = _train(
        ["--model", name, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
         layout, "--train-iters", "2", "--save", run_dir, "--save-interval", "2"], 2)
    if rank == 0:
        from megazoo.training.checkpoint import format as ckpt
        assert ckpt.read_meta(ckpt.resolve(run_dir))["layout"]["stage_layout"] == [1, 3]
        reshard(run_dir, run_dir + "-pp1", dp=2)
    dist.barrier()
    losses[f"{name} pp2 layout -> pp1 dp2 resume"] = _train(
        ["--model", name, "--load", run_dir + "-pp1"], 2)


def _world4(rank, packed):
    losses = {f"{name} cp4": _train(["--model", name, "--context-parallel-size", "4"], 4)
              for name in PRESETS}
    for name, layout in COMBINED.items():
        losses[f"{name} {' '.join(layout)}"] = _train(["--model", name] + layout, 4)
    return losses, _packed(*packed, cp=4)


@pytest.fixture(scope="module")
def references():
    """The unsharded trainer's losses per preset, and the packed-document references."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (module scope: before the autouse one_thread applies)
    try:
        return ({name: _train(["--model", name], 1)
                 for name in PRESETS + tuple(MOE_2) + ("qwen3-tiny",)},
                _packed_references())
    finally:
        torch.set_num_threads(threads)


def _assert_curves(losses: dict, refs: dict) -> float:
    worst = 0.0
    for what, got in losses.items():
        want = refs[what.split()[0]]
        if "resume" in what:  # the resumed run logs its third iteration only
            want = want[2:]
        if "saved" in what:  # the run that writes the checkpoint stops after two
            want = want[:2]
        assert len(got) == len(want) > 0, (what, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=what)
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
    return worst


def test_trainer_layouts_equal_the_unsharded_run(references):
    refs, packed = references
    with tempfile.TemporaryDirectory() as run_dir:
        out = run_distributed(_world2, 2, packed, run_dir, timeout=600)
    losses, checked = out[0]
    assert len(losses) == 3 * len(LAYOUTS_2) + len(EP2) + 1 + sum(map(len, MOE_2.values())) + 3
    assert len(checked) == 3 + len(CHAIN)
    assert _assert_curves(losses, refs) < 1e-5


def test_trainer_cp4_and_combined_layouts_equal_the_unsharded_run(references):
    refs, packed = references
    losses, checked = run_distributed(_world4, 4, packed, timeout=600)[0]
    assert len(losses) == 3 + len(COMBINED) and len(checked) == 3 + len(CHAIN)
    assert _assert_curves(losses, refs) < 1e-5


# ---------------------------------------------------------------- adapters (in process)
def _hf_models():
    from transformers import (NemotronHConfig, NemotronHForCausalLM, Qwen3_5ForCausalLM,
                              Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                              Qwen3NextConfig, Qwen3NextForCausalLM)
    qwen = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=6,
                layer_types=["linear_attention", "full_attention", "linear_attention",
                             "full_attention"], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                 "partial_rotary_factor": 0.5})
    return {
        "qwen3_5_text": (Qwen3_5ForCausalLM, Qwen3_5TextConfig(**qwen)),
        "qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig(
            **qwen, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, mlp_only_layers=[0])),
        # Qwen3.5's layers and names, every MLP sparse (no intermediate_size), an aux loss
        "qwen3_5_moe_text": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(
            **{k: v for k, v in qwen.items() if k != "intermediate_size"}, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            router_aux_loss_coef=0.01)),
        "nemotron_h": (NemotronHForCausalLM, NemotronHConfig(
            vocab_size=96, hidden_size=32, hybrid_override_pattern="M*M-",
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            mamba_num_heads=6, mamba_head_dim=6, ssm_state_size=8, n_groups=2, chunk_size=8,
            tie_word_embeddings=False)),
        # MoE ("E") layers beside dense ones: sigmoid routing, correction bias, groups, shared MLP
        "nemotron_h moe": (NemotronHForCausalLM, NemotronHConfig(
            vocab_size=96, hidden_size=32, hybrid_override_pattern="ME*-E",
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            mamba_num_heads=6, mamba_head_dim=6, ssm_state_size=8, n_groups=2, chunk_size=8,
            tie_word_embeddings=False, n_routed_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=3,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    }


def _check_aux_loss_coefficient(config, hf_config):
    """transformers' load-balancing loss times its coefficient equals megazoo's (Switch: shares
    of the T x k assignments, models/moe.py; tests/models/test_moe.py checks the router against
    it) times the imported coefficient, on one layer's router logits."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func
    e, k, tokens = config.num_experts, config.moe_router_topk, 40
    logits = torch.randn(tokens, e, generator=torch.Generator().manual_seed(5))
    counts = torch.bincount(logits.topk(k).indices.flatten(), minlength=e)
    ours = config.moe_aux_loss_coeff * e * (counts / (tokens * k) * logits.softmax(-1).mean(0)).sum()
    theirs = hf_config.router_aux_loss_coef * load_balancing_loss_func((logits,), e, k)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert ours > 0


def test_adapters_equal_transformers_and_export_bit_identical(tmp_path):
    from megazoo.models.generation import generate
    from megazoo.models.language_model import gather_logits
    from megazoo.models.registry import build_model, family
    from megazoo.parallel.sharding import load_full_state_dict
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    from megazoo.training.checkpoint.format import resolve
    from megazoo.training.checkpoint.hf import import_hf, load_model_chunks
    topo = ParallelTopology.from_config(ParallelConfig())
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    for what, (cls, hf_config) in _hf_models().items():
        name = what.split()[0]
        torch.manual_seed(0)
        hf = cls(hf_config).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            for bname, b in hf.named_buffers():  # the MoE correction bias steers the choice
                if bname.endswith("e_score_correction_bias"):
                    b.add_(torch.randn_like(b) * 0.05)
        adapter = family(name).adapter
        reference = hf_config.to_dict()  # (saving the model below records its dtype there)
        config = adapter.config_from_hf(hf_config).replace(linear_chunk_size=8)
        assert config.family == name
        if name in ("qwen3_next", "qwen3_5_moe_text"):
            _check_aux_loss_coefficient(config, hf_config)
        full = adapter.from_hf_state_dict(hf.state_dict(), config)
        model = build_model(config, topo)
        load_full_state_dict(model, full, topo)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(gather_logits(model(ids), topo, 96), hf(ids).logits,
                                       **TOL, msg=what)
        # greedy generation (constant-size states for linear layers, KV for attention) against
        # greedy decoding by transformers' full forward (its cached Nemotron-H generate departs
        # from its own forward here: token 10 of row 0)
        prompt = want = ids[:, :7]
        with torch.no_grad():
            for _ in range(6):
                want = torch.cat([want, hf(want).logits[:, -1].argmax(-1, keepdim=True)], 1)
        torch.testing.assert_close(generate(model, topo, prompt, 6), want, rtol=0, atol=0,
                                   msg=f"{what} greedy")
        back, state = adapter.to_hf_state_dict(full, config), hf.state_dict()
        assert back.keys() == state.keys(), what
        assert all(torch.equal(back[k], state[k]) for k in state), what
        # the real import path from a saved folder (Qwen3-Next's experts in the file form)
        hf.save_pretrained(tmp_path / what.replace(' ', '_'))
        import_hf(str(tmp_path / what.replace(' ', '_')), str(tmp_path / f"{what.replace(' ', '_')}-ckpt"))
        imported, (chunk,) = load_model_chunks(resolve(str(tmp_path / f"{what.replace(' ', '_')}-ckpt")), topo)
        assert imported.family == name
        with torch.no_grad():
            torch.testing.assert_close(gather_logits(chunk.eval()(ids), topo, 96),
                                       hf(ids).logits, **TOL, msg=f"{what} imported")
        written = adapter.hf_config(config).to_dict()
        for key, value in reference.items():
            if key not in ("architectures", "chunk_size", "transformers_version"):
                assert written[key] == value, (what, key, written[key], value)


def test_presets_equal_the_importers_and_fields_are_refused_where_unused():
    import dataclasses

    from transformers import (NemotronHConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                              Qwen3NextConfig)

    from megazoo.models.config import TransformerConfig
    from megazoo.models.nemotron_h import presets as nemotron
    from megazoo.models.presets import PRESETS, preset
    from megazoo.models.qwen3_5 import presets as qwen35
    from megazoo.models.qwen3_5_moe_text import presets as qwen35_moe
    from megazoo.models.qwen3_next import presets as qwen3_next
    from megazoo.models.registry import family
    for module, hf_cls, fam in ((qwen35, Qwen3_5TextConfig, "qwen3_5_text"),
                                (qwen3_next, Qwen3NextConfig, "qwen3_next"),
                                (qwen35_moe, Qwen3_5MoeTextConfig, "qwen3_5_moe_text"),
                                (nemotron, NemotronHConfig, "nemotron_h")):
        for name, fields in module.HF_PRESETS.items():
            assert preset(name) == family(fam).adapter.config_from_hf(hf_cls(**fields)), name
        assert family(fam).default_preset in PRESETS
    assert preset("qwen3-next-80b-a3b").is_moe_layer(0)
    base = dataclasses.asdict(preset("qwen3.5-tiny"))
    with pytest.raises(ValueError, match="mamba_num_heads, mamba_head_dim"):
        TransformerConfig(**{**base, "mamba_num_heads": 4})
    with pytest.raises(ValueError, match="rotary_fraction applies to RoPE attention"):
        TransformerConfig(**{**dataclasses.asdict(preset("gpt2")), "rotary_fraction": 0.5})
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    with pytest.raises(ArgumentError, match="does not divide the linear layers' mamba_groups"):
        to_run_config(build_parser().parse_args(
            ["--model", "nemotron-h-tiny", "--mock-data", "--seq-length", "32",
             "--tensor-model-parallel-size", "4", "--num-attention-heads", "8",
             "--num-query-groups", "4"]), world_size=4)
    with pytest.raises(ValueError, match="token_mixers are"):
        from megazoo.models.registry import build_model
        from megazoo.parallel.topology import ParallelConfig, ParallelTopology
        mixed = {**base, "token_mixers": ("gated_deltanet", "gated_attention",
                                           "attention", "gated_attention")}
        build_model(TransformerConfig(**mixed), ParallelTopology.from_config(ParallelConfig()))
