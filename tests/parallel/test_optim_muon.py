"""--optimizer muon against torch.optim.Muon (+ torch.optim.AdamW for the rest), unsharded and under
tp = 2, dp = 2 with ZeRO-1, 2 and 3, pp = 2 and ep = 2, by the shared rounding-robust rule; resume
bitwise; a trainer checkpoint continues at another layout; CPU offload bitwise; bf16/fp16 bounded.

The reference is the full model in one process: torch.optim.Muon(adjust_lr_fn="match_rms_adamw")
on the hidden matrices, torch.optim.AdamW on embeddings, biases and norms, gradients clipped
with torch.nn.utils.clip_grad_norm_. torch's Newton-Schulz is bf16 only, and bf16 rounding of the
input (gradients equal to fp32 rounding, summed in another order) moves a bf16 result by ~1e-2 of
the update, above the shared rule's 1e-3. So the reference's Newton-Schulz is evaluated in fp32
(torch's step otherwise unchanged) by `newton_schulz`, which `test_newton_schulz_and_assignment`
checks equal to torch's own iteration bit for bit in bf16; megazoo runs it in fp32 here too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.pipeline.engine import run_pipeline
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.pipeline.tied import broadcast_tied_embedding
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from megazoo.parallel.zero import build_optimizer
from megazoo.parallel.zero.muon import MuonSettings, assign_matrices, newton_schulz
from tests.distributed import run_distributed
from tests.muon_reference import MUON_FP32 as MUON
from tests.muon_reference import MUON_LR as LR
from tests.muon_reference import MUON_SEQ as SEQ
from tests.muon_reference import MUON_STEPS as STEPS
from tests.muon_reference import muon_batch as _batch
from tests.muon_reference import muon_full_parameters as _full
from tests.muon_reference import muon_gpt_config as _config
from tests.muon_reference import muon_moe_config as _moe_config
from tests.muon_reference import muon_opt_config as _opt_config
from tests.muon_reference import muon_reference as _reference
from tests.muon_reference import muon_train as _train
from tests.tolerances import (assert_curves_close, assert_params_equal, assert_trained_close,
                              update_deviation)

def test_newton_schulz_and_assignment():
    # 2-D: torch.optim.Muon's own iteration, to the bit; a batch of matrices: each one alone.
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    from torch.optim._muon import _zeropower_via_newtonschulz
    want = _zeropower_via_newtonschulz(x, MUON.ns_coefficients, 5, 1e-7)
    assert torch.equal(newton_schulz(x, MUON.ns_coefficients, 5, torch.bfloat16), want)
    assert torch.equal(newton_schulz(x.T, MUON.ns_coefficients, 5, torch.bfloat16),
                       _zeropower_via_newtonschulz(x.T, MUON.ns_coefficients, 5, 1e-7))
    batch = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(batch, MUON.ns_coefficients, 5, torch.float32)
    for e in range(3):
        torch.testing.assert_close(got[e], newton_schulz(batch[e], MUON.ns_coefficients, 5,
                                                         torch.float32), rtol=1e-5, atol=1e-6)
    # fp32 Newton-Schulz leaves singular values in the quintic's band (0.5, 1.5): orthogonal-ish.
    s = torch.linalg.svdvals(got[0].double())
    assert 0.5 < s.min() and s.max() < 1.5, s
    owner = assign_matrices([10, 3, 7, 7, 1], 2)
    loads = [sum(n for n, r in zip([10, 3, 7, 7, 1], owner) if r == k) for k in range(2)]
    assert sorted(loads) == [14, 14], (owner, loads)


def test_muon_unsharded_matches_torch_optim_muon():
    init, want, n_muon = _reference()
    topo = ParallelTopology.single()
    model, opt = _train(topo, _opt_config())
    assert sum(b.key.muon for b in opt.buffers) >= 1 and n_muon == 8
    names = {opt.param_names[s.index] for b in opt.buffers if b.key.muon for s in b.slots}
    assert names and not any("embedding" in n or n.endswith("bias") for n in names), names
    got = _full(model, opt, topo)
    assert_trained_close(got, want, init, "unsharded", LR)
    # CPU offload (a separate fp32 master, states on the host): the same arithmetic, bit for bit.
    assert_params_equal(_full(*_train(topo, _opt_config(zero_stage=1, offload="cpu")), topo), got,
                        "offload cpu")
    # bf16 / fp16 weights with fp32 masters stay near the fp32 run (||dw|| / ||w_fp32 - w_init||;
    # measured 0.027 and 0.0087), as test_zero.py bounds AdamW's.
    for dtype, bound in ((torch.bfloat16, 0.1), (torch.float16, 0.03)):
        low = _full(*_train(topo, _opt_config(), dtype=dtype), topo)
        assert update_deviation(low, got, init) < bound, dtype


def _loss_fn(chunk, inp, mb):
    out = chunk(mb["tokens"] if inp is None else inp,
                labels=mb["labels"] if chunk.post_process else None)
    return out.mean() if chunk.post_process else out


def _pp_train(topo):
    cfg = _config()
    chunks = [TransformerLanguageModel(cfg, topo, **s.kwargs())
              for s in partition(cfg.num_layers, topo.pp, 1)[topo.pp_rank]]
    broadcast_tied_embedding(chunks, topo)
    opt = build_optimizer(chunks, topo, _opt_config(zero_stage=1))
    schedule = build_schedule("1f1b", topo.pp, topo.pp_rank, 2)
    for step in range(STEPS):
        ids, labels = _batch(step, topo)
        mbs = [{"tokens": t, "labels": y} for t, y in zip(ids.chunk(2), labels.chunk(2))]
        with opt.no_sync():
            run_pipeline(schedule, chunks, mbs, topo, (SEQ, 4, cfg.hidden_size), torch.float32,
                         _loss_fn)
        assert not opt.step().skipped
        opt.zero_grad()
    out = {}
    for chunk in chunks:
        out.update(_full(chunk, opt, topo))
    return out


TRAINER = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
           "--vocab-size", "61", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--lr", "3e-3", "--log-interval", "100", "--eval-interval", "1000", "--seed", "5",
           "--optimizer", "muon", "--muon-ns-dtype", "fp32", "--zero-stage", "1"]


def _pretrain(*extra):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    return pretrain(model_provider, to_run_config(build_parser().parse_args(TRAINER + list(extra)),
                                                  world_size=2))


def _reshard(root):
    """The trainer: saved at dp = 2 after 3 iterations, continued to 5 at dp = 2 and at tp = 2.
    Iteration 5's loss depends on the momentum buffers loaded (iteration 4's on weights only)."""
    _pretrain("--train-iters", "3", "--save", root)
    same = _pretrain("--train-iters", "5", "--load", root).losses
    tp2 = _pretrain("--train-iters", "5", "--load", root, "--tensor-model-parallel-size", "2").losses
    assert_curves_close(tp2, same, "muon dp=2 -> tp=2", rtol=1e-5)
    return f"resharded dp=2 -> tp=2: iterations 4-5 losses {same}"


def _layouts_worker(rank, root, dense_reference, moe_reference):
    init, want, _ = dense_reference
    checked = []
    for kw, stages in ((dict(tp=2), (1,)), (dict(), (1, 2, 3)), (dict(pp=2), (None,))):
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        for stage in stages:
            where = f"{kw or 'dp=2'} zero={stage}"
            if stage is None:
                got = _pp_train(topo)
            else:
                model, opt = _train(topo, _opt_config(zero_stage=stage))
                got = _full(model, opt, topo)
            dev = assert_trained_close(got, want, init, where, LR)
            checked.append(f"{where}: deviation {dev:.1e}")
    # ep = 2 (dp = 2): expert weights orthogonalised per expert, without any EP gather.
    init, want, _ = moe_reference
    topo = ParallelTopology.from_config(ParallelConfig(ep=2))
    model, opt = _train(topo, _opt_config(zero_stage=1), config=_moe_config)
    assert any(b.key.muon and b.key.expert for b in opt.buffers)
    dev = assert_trained_close(_full(model, opt, topo), want, init, "ep=2 zero=1", LR)
    checked.append(f"ep=2 zero=1: deviation {dev:.1e}")
    # Resume under dp = 2 ZeRO-1: 3 steps, state_dict, 2 more == 5 straight, bit for bit.
    topo = ParallelTopology.from_config(ParallelConfig())
    straight = _full(*_train(topo, _opt_config(zero_stage=1)), topo)
    model, opt = _train(topo, _opt_config(zero_stage=1), steps=3)
    sd = {k: v.clone() for k, v in opt.state_dict().items()}
    model2 = TransformerLanguageModel(_config(), topo)
    opt2 = build_optimizer(model2, topo, _opt_config(zero_stage=1))
    opt2.load_state_dict(sd)
    assert any(k.endswith("momentum_buffer") for k in sd)
    assert_params_equal(_full(*_train(topo, None, steps=2, model=model2, opt=opt2), topo),
                        straight, "resume")
    checked.append(_reshard(root))
    dist.barrier()
    return checked


def test_muon_layouts_match_reference_resume_and_reshard(tmp_path):
    results = run_distributed(_layouts_worker, 2, str(tmp_path / "ckpt"), _reference(),
                              _reference(_moe_config), timeout=300)
    assert len(results[0]) == 7
    print("\n".join(results[0]))


def test_muon_flags_map_and_refuse():
    import pytest
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
            "--vocab-size", "61", "--micro-batch-size", "2", "--train-iters", "4"]

    def run(*extra):
        return to_run_config(build_parser().parse_args(base + list(extra)), world_size=1).optimizer

    cfg = run("--optimizer", "muon", "--muon-momentum", "0.9", "--no-muon-use-nesterov",
              "--muon-num-ns-steps", "6", "--muon-scale-mode", "shape_scaling",
              "--muon-extra-scale-factor", "1.0", "--muon-ns-dtype", "bf16",
              "--muon-adamw-params", "embedding", "output_layer", "fc2")
    assert cfg.optimizer == "muon" and cfg.muon == MuonSettings(
        momentum=0.9, nesterov=False, ns_steps=6, scale_mode="shape_scaling",
        extra_scale_factor=1.0, ns_dtype="bf16", adamw_patterns=("embedding", "output_layer", "fc2"))
    assert run("--optimizer", "muon").muon == MuonSettings()
    with pytest.raises(ArgumentError, match="--muon-momentum apply to --optimizer muon only"):
        run("--muon-momentum", "0.9")
    with pytest.raises(ArgumentError, match="--muon-num-ns-steps must be in"):
        run("--optimizer", "muon", "--muon-num-ns-steps", "0")
    with pytest.raises(ArgumentError, match="--muon-adamw-params"):
        run("--optimizer", "muon", "--muon-adamw-params", "(")
