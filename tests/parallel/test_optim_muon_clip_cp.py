"""Muon with QK-clip under tp = 2 and dp = 2 (ZeRO-1) against the unsharded run, after 3 steps
with clipping active, heads' largest logits included; Muon under cp = 2 (ring attention)
against the single-process torch.optim.Muon + AdamW reference after 5 steps. One world.

QK-clip's own semantics (which heads, by how much) are checked unsharded in test_qk_clip.py; here
the question is the layouts: TP ranks clip their own heads, data-parallel ranks agree on the
maxima through the MAX reduction, and ZeRO's sharded masters take the factors exactly.
"""
from __future__ import annotations

import functools

import torch.distributed as dist

from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from megazoo.parallel.zero import build_optimizer
from megazoo.parallel.zero.qk_clip import QKClipSettings
from tests.distributed import run_distributed
from tests.helpers import qk_clip_check_run, qk_clip_tau_amid, qk_clip_train
from tests.muon_reference import (MUON_LR, muon_batch, muon_full_parameters, muon_gpt_config,
                                   muon_opt_config, muon_reference, muon_train)
from tests.tolerances import assert_trained_close

CLIP_STEPS = 3


def _clip_run(topo, tau: float):
    """(full parameters, per step the heads' maxima [layers, heads], per step heads clipped)."""
    model = TransformerLanguageModel(muon_gpt_config(), topo)
    opt = build_optimizer(model, topo, muon_opt_config(
        zero_stage=1, qk_clip=QKClipSettings(threshold=tau)))
    return qk_clip_train(model, opt, topo, [muon_batch(step, topo) for step in range(CLIP_STEPS)])


@functools.lru_cache(maxsize=None)
def _clip_reference():
    """The unsharded run with tau amid the first step's maxima (half the heads over it): some over,
    some under, at every step."""
    single = ParallelTopology.single()
    init = muon_reference()[0]  # the same model's initial parameters
    _, first, _ = _clip_run(single, 1e9)
    tau = qk_clip_tau_amid(first[:1])  # amid the first step's heads
    params, maxima, clipped = _clip_run(single, tau)
    assert all(0 < c < first[0].numel() for c in clipped), clipped
    return init, params, maxima, clipped, tau


def _worker(rank, clip_reference, muon_ref):
    tau = clip_reference[-1]
    checked = []
    for kw in (dict(tp=2), dict()):
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        checked.append(qk_clip_check_run(_clip_run(topo, tau), clip_reference,
                                         f"qk-clip {kw or 'dp=2 zero=1'}", MUON_LR))
    init, want, _ = muon_ref
    topo = ParallelTopology.from_config(ParallelConfig(cp=2))
    model, opt = muon_train(topo, muon_opt_config(zero_stage=1))
    dev = assert_trained_close(muon_full_parameters(model, opt, topo), want, init, "cp=2 ring",
                               MUON_LR)
    checked.append(f"muon cp=2 ring zero=1: deviation {dev:.1e}")
    dist.barrier()
    return checked


def test_muon_qk_clip_tp_dp_and_muon_cp_match_the_references():
    results = run_distributed(_worker, 2, _clip_reference(), muon_reference(), timeout=300)
    assert len(results[0]) == 3
    print("\n".join(results[0]))
