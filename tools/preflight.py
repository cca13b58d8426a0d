"""Check a layout's numerics before launching it: a CPU twin of the run (same family, layer kinds
and pattern, shrunk sizes; each parallel dimension above 1 kept at 2, with its ZeRO stage,
recompute and precision) trains a few steps sharded and unsharded, and the largest divergences of
loss, gradient norm and parameters are printed with a verdict (training/planning/preflight.py).

    python tools/preflight.py torchrun --nproc-per-node 8 train_moe.py --model mixtral-8x7b \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --expert-model-parallel-size 2 --zero-stage 1 --bf16 ...
    python tools/preflight.py train_gpt.py --model gpt2 --tp 2 --pp 2 --cp 2 ...

The training command is taken unchanged (the launcher, if any, tells the run's data-parallel
size). Exit status: 0 within tolerance, 1 a divergence, 2 a command it cannot read.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from megazoo.models.registry import family
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser
from megazoo.training.planning.preflight import preflight
from megazoo.training.planning.twin import twin_run
from megazoo.training.run.cli import SCRIPTS
from megazoo.training.run.entry import loaded_model

LAUNCHER_VALUES = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank",
                   "--node_rank", "--master-addr", "--master_addr", "--master-port",
                   "--master_port", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                   "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--max-restarts", "--max_restarts"}


def split_command(words: list[str]) -> tuple[str, list[str], int | None]:
    """(the script's kind in cli.SCRIPTS, its flags, the launcher's world size or None) of a
    training command: `[torchrun [options]] train_X.py FLAGS`, `megazoo-train-X FLAGS` or
    `[python] -m megazoo.training.run.cli X FLAGS`."""
    world, nproc, nnodes, i = None, None, 1, 0
    while i < len(words):
        w = words[i]
        name, _, inline = w.partition("=")
        m = re.fullmatch(r"(?:.*/)?(?:train_|megazoo-train-)(\w+?)(?:\.py)?", w)
        if m and m[1] in SCRIPTS:
            kind, rest = m[1], words[i + 1:]
            break
        if w == "-m" and i + 2 < len(words) and words[i + 1] == "megazoo.training.run.cli":
            kind, rest = words[i + 2], words[i + 3:]
            break
        if name in LAUNCHER_VALUES:
            value = inline or words[i + 1]
            if name.startswith("--nproc"):
                nproc = int(value)
            if name == "--nnodes":
                nnodes = int(value.split(":")[-1])
            i += 1 if inline else 2
            continue
        i += 1
    else:
        raise ValueError("no training script in the command (train_gpt.py, megazoo-train-moe, "
                         "-m megazoo.training.run.cli gpt, ...): give the command as you launch it")
    if kind not in SCRIPTS:
        raise ValueError(f"-m megazoo.training.run.cli {kind}: one of {sorted(SCRIPTS)}")
    if nproc:
        world = nproc * nnodes
    return kind, rest, world


def read_command(words: list[str]):
    """(the RunConfig of a training command, its data-parallel size or None when the command
    does not tell the world size)."""
    kind, flags, world = split_command(words)
    args = build_parser(family(SCRIPTS[kind], "preflight").default_preset).parse_args(flags)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * \
        args.context_parallel_size
    eod = 1 if args.reset_attention_mask or args.reset_position_ids else None
    run = to_run_config(args, world_size=world or model_parallel * max(
        1, args.expert_model_parallel_size // args.context_parallel_size),
        eod_token=eod, loaded=loaded_model(args.load))
    return run, world // model_parallel if world else None


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps of each twin run")
    p.add_argument("--worker-setup", help="fault drill: module:function each rank runs first")
    p.add_argument("--start-method", choices=("fork", "spawn"),
                   default="fork" if sys.platform == "linux" else "spawn",
                   help="how the twin's ranks start (fork: no torch import per rank)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, unchanged")
    a = p.parse_args(argv)
    words = a.command[1:] if a.command[:1] == ["--"] else a.command
    try:
        twin, twin_dp = twin_run(*read_command(words), steps=a.steps)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = twin.model
    print(f"twin of the {m.family} run: hidden {m.hidden_size}, {m.num_layers} layers, "
          f"{m.num_attention_heads} heads"
          + (f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else "")
          + f", sequence {twin.data.seq_length}, mock tokens, {a.steps} steps at lr "
          f"{twin.schedule.lr:g}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = preflight(twin, twin_dp, setup=a.worker_setup, start_method=a.start_method)
    print("\n".join(report.lines()))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
