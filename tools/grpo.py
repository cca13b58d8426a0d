"""GRPO online training of a megazoo checkpoint: an alias of the training script of --load's
family with --grpo-prompts (docs/post_training.md). The optimizer, LR schedule, ZeRO, layouts,
checkpoints and run log are the trainer's; every flag is a training flag.

    python tools/grpo.py --load ckpt/llama --finetune --grpo-prompts prompts.jsonl \\
        --reward examples.grpo.rewards:sum_digit --num-generations 8 --max-completion-length 16 \\
        --micro-batch-size 8 --global-batch-size 32 --train-iters 50 --lr 1e-5 --save runs/grpo
    torchrun --nproc_per_node 2 tools/grpo.py --tensor-model-parallel-size 2 ...

is `train_<family>.py` with the same flags, plus the checkpoint's tokenizer folder as
--tokenizer-model (HuggingFaceTokenizer) when no tokenizer flag is given. --reward's module is
imported by name, from PYTHONPATH or the working directory (`examples.grpo.rewards`: run from the
checkout's root); each record's fields reach the function by name (`sum_digit` reads `answer`,
the last digit of a + b, as examples/grpo/run_example.py writes its prompts).
"""
from __future__ import annotations

import os
import sys

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.tokenizer import tokenizer_dir

TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")


def alias_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(the family of --load's checkpoint, the training flags)."""
    given = {a.split("=", 1)[0] for a in argv}
    if "--grpo-prompts" not in given:
        raise ValueError("tools/grpo.py runs GRPO: give --grpo-prompts FILE.jsonl and --reward "
                         "MODULE:FUNCTION (the other flags are train_*.py's)")
    loads = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--load"] + \
        [a.split("=", 1)[1] for a in argv if a.startswith("--load=")]
    if not loads:
        raise ValueError("tools/grpo.py needs --load CKPT (the model to train; add --finetune to "
                         "start from an imported model)")
    folder = ckpt.resolve(loads[-1])
    family = ckpt.read_meta(folder)["model"]["family"]
    if not given & set(TOKENIZER_FLAGS) and os.path.isdir(tokenizer_dir(folder)):
        argv = [*argv, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                tokenizer_dir(folder)]
    return family, argv


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        family, argv = alias_argv(argv)
    except (ValueError, ckpt.CheckpointError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    from megazoo.training.run.entry import main as train
    train(family, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
