"""The --muon-* flags (Megatron-core's names where it has them) and the MuonSettings they make.

Defaults are torch.optim.Muon's (momentum 0.95, Nesterov) with Moonlight's update scale
(spectral x 0.2: the update's RMS matches AdamW's, so --lr serves Muon and AdamW alike).
Megatron-core's defaults differ (momentum 0.9, no Nesterov, extra scale 1.0): pass them
explicitly to reproduce a Megatron run. A --muon-* flag without --optimizer muon is refused.

QK-clip (MuonClip) takes Megatron-core's names: --qk-clip, --qk-clip-threshold, --qk-clip-alpha;
it runs after the step of any optimizer (parallel/zero/qk_clip.py).
"""
from __future__ import annotations

import argparse

from megazoo.parallel.zero.muon import DEFAULT_ADAMW_PATTERNS, NS_DTYPES, SCALE_MODES, MuonSettings
from megazoo.parallel.zero.qk_clip import QKClipSettings, qk_clip_refusal

_DEFAULTS = MuonSettings()


def add_muon_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("muon (with --optimizer muon)")
    g.add_argument("--muon-momentum", type=float,
                   help=f"momentum of the Muon matrices (default {_DEFAULTS.momentum})")
    g.add_argument("--muon-use-nesterov", action=argparse.BooleanOptionalAction,
                   help="Nesterov momentum (default on; --no-muon-use-nesterov: plain momentum)")
    g.add_argument("--muon-num-ns-steps", type=int,
                   help=f"Newton-Schulz iterations (default {_DEFAULTS.ns_steps})")
    g.add_argument("--muon-ns-coefficients", type=float, nargs=3, metavar=("A", "B", "C"),
                   help="coefficients of the quintic Newton-Schulz step (default Keller "
                        f"Jordan's {_DEFAULTS.ns_coefficients})")
    g.add_argument("--muon-scale-mode", choices=sorted(SCALE_MODES),
                   help="learning-rate factor of an (out, in) matrix: spectral sqrt(max(out, in)), "
                        "shape_scaling sqrt(max(1, out/in)), unit_rms_norm sqrt(out/in) "
                        f"(default {_DEFAULTS.scale_mode})")
    g.add_argument("--muon-extra-scale-factor", type=float,
                   help="times the scale mode's factor (default "
                        f"{_DEFAULTS.extra_scale_factor}: with spectral, AdamW's update RMS)")
    g.add_argument("--muon-ns-dtype", choices=sorted(NS_DTYPES),
                   help="dtype of the Newton-Schulz matmuls (default bf16, as torch.optim.Muon; "
                        "fp32 on CPUs without native bf16)")
    g.add_argument("--muon-adamw-params", nargs="+", metavar="REGEX",
                   help="matrices whose names match any of these get AdamW (default: "
                        f"{' '.join(DEFAULT_ADAMW_PATTERNS)}); 1-D parameters always do")
    q = p.add_argument_group("QK-clip (MuonClip, Kimi K2)")
    q.add_argument("--qk-clip", action="store_true",
                   help="after each step, rescale the query/key projections of every head whose "
                        "largest attention logit exceeded --qk-clip-threshold (docs/muon.md)")
    q.add_argument("--qk-clip-threshold", type=float,
                   help=f"the logit bound tau (default {QKClipSettings.threshold:g})")
    q.add_argument("--qk-clip-alpha", type=float,
                   help="the query's share of the rescaling: q by gamma^alpha, k by "
                        f"gamma^(1-alpha) (default {QKClipSettings.alpha})")


_FIELDS = {"muon_momentum": "momentum", "muon_use_nesterov": "nesterov",
           "muon_num_ns_steps": "ns_steps", "muon_ns_coefficients": "ns_coefficients",
           "muon_scale_mode": "scale_mode", "muon_extra_scale_factor": "extra_scale_factor",
           "muon_ns_dtype": "ns_dtype", "muon_adamw_params": "adamw_patterns"}


def muon_settings(args: argparse.Namespace, fail) -> MuonSettings:
    """The settings the flags give; `fail(message)` raises when one is given without muon."""
    given = {field: getattr(args, flag) for flag, field in _FIELDS.items()
             if getattr(args, flag, None) is not None}
    if given and args.optimizer != "muon":
        flags = [f"--{f.replace('_', '-')}" for f in _FIELDS if getattr(args, f, None) is not None]
        fail(f"{' '.join(flags)} apply to --optimizer muon only; add --optimizer muon or drop them")
    for key in ("ns_coefficients", "adamw_patterns"):
        if key in given:
            given[key] = tuple(given[key])
    return MuonSettings(**given)


def qk_clip_settings(args: argparse.Namespace, model, cp: int, fail) -> QKClipSettings | None:
    """--qk-clip's settings (None: off); `model` the TransformerConfig, `cp` the context size."""
    given = [f for f in ("qk_clip_threshold", "qk_clip_alpha")
             if getattr(args, f, None) is not None]
    if not getattr(args, "qk_clip", False):
        if given:
            fail(f"{' '.join('--' + f.replace('_', '-') for f in given)} apply with --qk-clip "
                 f"only; add --qk-clip or drop them")
        return None
    refusal = qk_clip_refusal(qk_layernorm=model.qk_layernorm, cp=cp)
    if refusal:
        fail(refusal)
    return QKClipSettings(**{f[len("qk_clip_"):]: getattr(args, f) for f in given})
