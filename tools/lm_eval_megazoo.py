"""lm-evaluation-harness's command line with megazoo registered as a model: evaluate a megazoo
checkpoint of any layout without exporting it.

    python -m megazoo.tools.lm_eval_megazoo run --model megazoo \\
        --model_args load=ckpt/run,batch_size=8 --tasks hellaswag --limit 100
    torchrun --nproc_per_node 4 -m megazoo.tools.lm_eval_megazoo run --model megazoo \\
        --model_args load=ckpt/run,tp=2,pp=2 --tasks tests/fixtures/lm_eval/tiny_mc.yaml

lm-eval 0.4.13 discovers models only through its registry (no plugin entry points), so this
wrapper registers `megazoo` and hands the rest of the command line to lm-eval's own CLI
(every flag of `lm_eval run` works). Under torchrun each process is one rank of the layout
given by tp/pp in --model_args; rank 0 prints and writes the results. A task given as a YAML
path is loaded from that file (its `!function` helpers from beside it).
"""
from __future__ import annotations

import logging
import os
import sys


def main(argv=None) -> int:
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from megazoo.training.evaluation.harness import register
    argv = list(sys.argv[1:] if argv is None else argv)
    register()
    setup_logging()
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # one voice: the other ranks compute alongside
        logging.getLogger("lm-eval").setLevel(logging.ERROR)
    parser = HarnessCLI()
    sys.argv = [sys.argv[0]] + argv  # lm-eval's parser reads sys.argv
    args = parser.parse_args()
    parser.execute(args)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
