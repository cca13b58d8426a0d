"""Print a megazoo checkpoint's layout, iteration, model and tensors, and verify every shard.

    python tools/inspect_checkpoint.py CKPT_DIR [--tensors] [--verify]

CKPT_DIR is a --save folder (its `latest` checkpoint is inspected) or one iter_* folder. A
Megatron-LM checkpoint (legacy or torch_dist) is named with its format, iteration and layout (convert it with
tools/convert_checkpoint.py). Every
rank's shard must be present and fully readable; with --verify every tensor is also checked
against the crc32 recorded at save (one line per damaged file and tensor). The exit status is 1
when anything is wrong.
"""
import argparse
import os
import sys

from megazoo.training.checkpoint.format import (CheckpointError, VerifiedReader, listed_files,
                                        read_resumable_meta, resolve)


def _shapes(path: str, verify: bool) -> tuple[dict, int]:
    """name -> (dtype, shape) and total bytes; reads every tensor, so truncation cannot hide, and
    with `verify` checks each against its checksum (the first mismatch is raised)."""
    reader = VerifiedReader(path)
    if not verify:
        reader.table = None  # read everything, compare nothing
    shapes, total = {}, 0
    for name in reader.keys():
        t = reader.get_tensor(name)
        shapes[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        total += t.numel() * t.element_size()
    if verify and reader.unlisted():
        raise CheckpointError(f"{path}: tensor {reader.unlisted()[0]} is missing (the file was cut or edited)")
    return shapes, total


def _foreign(path: str) -> str | None:
    """One line naming another framework's checkpoint format and layout, else None."""
    from megazoo.training.checkpoint.foreign import deepspeed, megatron_dist, megatron_legacy, torchtitan
    if deepspeed.is_universal(path) or deepspeed.is_pipeline_layout(path) or deepspeed.is_zero(path):
        return deepspeed.describe(path) + "; convert with tools/convert_checkpoint.py import --format deepspeed"
    if megatron_dist.is_dist(path):
        return megatron_dist.describe(path) + "; convert with tools/convert_checkpoint.py import --format megatron-dist"
    if torchtitan.is_torchtitan(path):
        return torchtitan.describe(path) + "; convert with tools/convert_checkpoint.py import --format torchtitan"
    if megatron_legacy.is_legacy(path):
        return megatron_legacy.describe(path) + "; convert with tools/convert_checkpoint.py import --format megatron"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--tensors", action="store_true", help="list every tensor of every shard")
    ap.add_argument("--verify", action="store_true", help="check every tensor against its checksum")
    args = ap.parse_args()
    foreign = _foreign(args.path)
    if foreign:
        print(foreign)
        return 0
    try:
        folder = resolve(args.path)
        meta = read_resumable_meta(folder)  # the fields a resume reads, checked
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lay, model = meta.get("layout", {}), meta.get("model", {})
    print(f"{folder}: iteration {meta.get('iteration')}, consumed samples {meta.get('consumed_samples')}")
    print(f"layout: tp={lay.get('tp')} pp={lay.get('pp')} dp={lay.get('dp')} vpp={lay.get('vpp')} "
          f"zero={lay.get('zero_stage')} world={lay.get('world_size')}")
    print("model: " + ", ".join(f"{k}={model[k]}" for k in (
        "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
        "position_embedding", "params_dtype") if k in model))
    problems = []
    files = listed_files(folder, meta)
    for path in files:
        name = os.path.basename(path)
        if not os.path.exists(path):
            problems.append(f"{path}: missing")
            continue
        try:
            shapes, total = _shapes(path, verify=args.verify)
        except CheckpointError as e:  # names the file and, for a checksum, the tensor
            problems.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001 - any failure to read is what we report
            problems.append(f"{path}: unreadable, corrupt or truncated ({type(e).__name__}: {e})")
            continue
        n_model = sum(k.startswith("model.") for k in shapes)
        print(f"  {name}: {len(shapes)} tensors ({n_model} model, {len(shapes) - n_model} optimizer/RNG), "
              f"{total / 2**20:.2f} MiB")
        if args.tensors:
            for k, (dtype, shape) in sorted(shapes.items()):
                print(f"    {k:60s} {dtype:9s} {shape}")
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        return 1
    print(f"all {len(files)} shards readable" + (", every tensor matches its checksum" if args.verify else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
