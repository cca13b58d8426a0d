"""The layout flags, defined once: the trainer, the converters, the resharder and the planner all
add them from `LAYOUT_FLAGS`, read them back with `parallel_config_of`, and write them out again
(the planner's launch command) with `layout_argv`. Megatron-LM's spelling comes first; the short
forms (`--tp`, `--pp`, `--vpp`, `--cp`, `--ep`, `--dp`) are aliases every tool accepts.

The layout itself is one object, `parallel.layout.ParallelConfig`; the data-parallel size (which
the trainer derives from the world size and a converter is told) and the ZeRO stage travel beside
it where a checkpoint is written for a layout.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from megazoo.parallel.context_parallel import COMM_TYPES
from megazoo.parallel.layout import LayoutError, ParallelConfig, virtual_stages
from megazoo.parallel.pipeline.layer_layout import format_layout, parse_layout


@dataclass(frozen=True)
class LayoutFlag:
    names: tuple[str, ...]  # Megatron-LM's spelling, then aliases
    field: str  # a ParallelConfig field, or dp / zero_stage / layers_per_virtual_stage
    help: str
    kind: object = int  # int, "switch" (store_true), a tuple of choices, or a parse function

    @property
    def dest(self) -> str:
        return self.names[0][2:].replace("-", "_")


LAYOUT_FLAGS = (
    LayoutFlag(("--tensor-model-parallel-size", "--tp"), "tp",
               "tensor-parallel size (divides heads, hidden and vocabulary)"),
    LayoutFlag(("--pipeline-model-parallel-size", "--pp"), "pp", "pipeline stages (divides the layers)"),
    LayoutFlag(("--virtual-pipeline-model-parallel-size", "--vpp"), "vpp",
               "model chunks per pipeline rank: interleaved 1F1B"),
    LayoutFlag(("--num-layers-per-virtual-pipeline-stage",), "layers_per_virtual_stage",
               "Megatron's form of the virtual pipeline size: layers per virtual stage"),
    LayoutFlag(("--decoder-first-pipeline-num-layers",), "first_stage_layers",
               "layers on the first pipeline stage (uneven split; it also holds the embedding); "
               "the other stages share the rest evenly"),
    LayoutFlag(("--decoder-last-pipeline-num-layers",), "last_stage_layers",
               "layers on the last pipeline stage (it also holds the head and loss)"),
    LayoutFlag(("--pipeline-model-parallel-layout",), "stage_layout",
               "layers of every pipeline stage in model order, Megatron-core's syntax: stages "
               "separated by '|', 'E' embedding (opens the first), 't' a decoder layer, 'L' loss "
               "(closes the last), 't*3' repeats, e.g. 'Et*3|t*5L'; pp x vpp stages set vpp",
               parse_layout),
    LayoutFlag(("--sequence-parallel",), "sequence_parallel",
               "shard norms and dropout activations along the sequence over tp", "switch"),
    LayoutFlag(("--context-parallel-size", "--cp"), "cp",
               "split every sample's sequence over this many ranks (carved from data "
               "parallelism); each holds chunks i and 2C-1-i (load-balanced causal)"),
    LayoutFlag(("--cp-comm-type",), "cp_comm_type",
               "context-parallel attention: p2p = ring attention (K/V blocks around the ring), "
               "a2a = all-to-all over heads (DeepSpeed-Ulysses)", COMM_TYPES),
    LayoutFlag(("--expert-model-parallel-size", "--ep"), "ep",
               "ranks (carved out of data parallelism) splitting each layer's experts"),
    LayoutFlag(("--data-parallel-size", "--dp"), "dp",
               "data-parallel ranks of the layout written (a training run takes it from the world)"),
    LayoutFlag(("--zero-stage",), "zero_stage",
               "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also weights (training: "
               "default 0, or 1 with --use-distributed-optimizer)"),
)
BY_FIELD = {f.field: f for f in LAYOUT_FLAGS}
_PARALLEL = {f.name for f in dataclasses.fields(ParallelConfig)}
_DEFAULTS = {**{f.name: f.default for f in dataclasses.fields(ParallelConfig)},
             "dp": 1, "zero_stage": 0, "layers_per_virtual_stage": None}
_FORMAT = {"stage_layout": format_layout}  # fields written back as something other than str()


def add_layout_flags(parser: argparse.ArgumentParser, *, fields=None, searched: bool = False,
                     defaults: dict | None = None, title: str = "parallel layout"):
    """Add the layout flags of `fields` (None: all) in one group. searched: every default is None
    (a value given is pinned; the planner searches the rest); `defaults`: by field."""
    group = parser.add_argument_group(title)
    for flag in LAYOUT_FLAGS:
        if fields is not None and flag.field not in fields:
            continue
        default = None if searched else (defaults or {}).get(flag.field, _DEFAULTS[flag.field])
        if flag.kind == "switch":
            group.add_argument(*flag.names, dest=flag.dest, action="store_true",
                               default=default, help=flag.help)
        elif isinstance(flag.kind, tuple):
            group.add_argument(*flag.names, dest=flag.dest, choices=flag.kind, default=default,
                               help=flag.help)
        elif flag.kind is not int:
            group.add_argument(*flag.names, dest=flag.dest, type=_parser(flag.kind, flag.names),
                               default=default, help=flag.help)
        else:
            group.add_argument(*flag.names, dest=flag.dest, type=flag.kind, default=default,
                               help=flag.help)
    return group


def given(args, field: str):
    """The value of a layout flag in parsed `args` (None: not a flag of that parser, or unset)."""
    return getattr(args, BY_FIELD[field].dest, None)


def parallel_config_of(args, num_layers: int | None, *,
                       stage_layers: tuple | None = None) -> ParallelConfig:
    """The `ParallelConfig` the layout flags in `args` ask for (flags a parser lacks: defaults).
    `num_layers`: the model's (None: not known yet, so --num-layers-per-virtual-pipeline-stage
    cannot be resolved); `stage_layers`: (first, last) when something else decided them
    (--pp-partition-method)."""
    fields = {}
    for flag in LAYOUT_FLAGS:
        value = getattr(args, flag.dest, None)
        if flag.field in _PARALLEL:
            fields[flag.field] = _DEFAULTS[flag.field] if value is None else value
    if stage_layers is not None:
        fields["first_stage_layers"], fields["last_stage_layers"] = stage_layers
    per_stage = given(args, "layers_per_virtual_stage")
    if per_stage and num_layers is None:
        raise LayoutError("--num-layers-per-virtual-pipeline-stage needs the model's layer count, "
                          "which this command does not know before reading the checkpoint; give "
                          "--virtual-pipeline-model-parallel-size instead")
    if per_stage:
        vpp = virtual_stages(num_layers, fields["pp"], per_stage)
        if given(args, "vpp") not in (None, 1, vpp):
            raise LayoutError(f"--virtual-pipeline-model-parallel-size {given(args, 'vpp')} "
                              f"contradicts --num-layers-per-virtual-pipeline-stage {per_stage} "
                              f"({vpp} virtual stages); give one of them")
        fields["vpp"] = vpp
    layout = fields.get("stage_layout")
    if layout is not None:
        if stage_layers not in (None, (None, None)):
            raise LayoutError("give one of --pipeline-model-parallel-layout and "
                              "--decoder-first/last-pipeline-num-layers (or --pp-partition-method)")
        if len(layout) % fields["pp"]:
            raise LayoutError(f"--pipeline-model-parallel-layout lists {len(layout)} stages, not a "
                              f"multiple of --pipeline-model-parallel-size {fields['pp']}")
        vpp = len(layout) // fields["pp"]
        if (given(args, "vpp") or 1) not in (1, vpp) or (per_stage and fields["vpp"] != vpp):
            raise LayoutError(f"--pipeline-model-parallel-layout lists {vpp} virtual stages per "
                              f"rank; drop the virtual pipeline size flag or make it {vpp}")
        fields["vpp"] = vpp
    return ParallelConfig(**fields)


def layout_argv(parallel: ParallelConfig, *, dp: int | None = None,
                zero_stage: int | None = None) -> list[str]:
    """The layout flags that ask for `parallel` (values that differ from the defaults, and tp,
    pp and the ZeRO stage always): the inverse of `parallel_config_of`."""
    values = {f.name: getattr(parallel, f.name) for f in dataclasses.fields(ParallelConfig)}
    values.update(dp=dp, zero_stage=zero_stage)
    argv: list[str] = []
    for flag in LAYOUT_FLAGS:
        value = values.get(flag.field)
        if value is None or (value == _DEFAULTS[flag.field]
                             and flag.field not in ("tp", "pp", "zero_stage")):
            continue
        if flag.kind == "switch":
            argv += [flag.names[0]] if value else []
        else:
            argv += [flag.names[0], _FORMAT.get(flag.field, str)(value)]
    return argv


def _parser(parse, names):
    """`parse` for argparse: its one-line refusal becomes the usage error (which names the flag
    already)."""
    def convert(text):
        try:
            return parse(text)
        except LayoutError as e:
            message = str(e)
            for name in names:
                message = message.removeprefix(name + " ")
            raise argparse.ArgumentTypeError(message) from None
    convert.__name__ = parse.__name__
    return convert
