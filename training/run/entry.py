"""What every reference script shares: parse flags, build the tokenizer, run `pretrain`, end cleanly.

Exit codes: 0 on success (also after --exit-interval / --exit-duration-in-mins), 2 for a bad flag or
configuration (one line from rank 0, no traceback), 1 for a run that fails with a user error (a
missing or corrupt file: one line, no traceback) or a bug (traceback), 143 / 130 after SIGTERM / SIGINT
(the checkpoint written first when --save is set). A run log that cannot be written (a full disk)
ends the run with one line from the rank that failed and exit code 1. The process groups are destroyed on every path.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import torch.distributed as dist

from megazoo.data.indexed import IndexedDatasetError
from megazoo.data.token_stats import VocabularyMismatch
from megazoo.data.tokenizers import TokenizerError, loss_pad_id
from megazoo.models.config import TransformerConfig
from megazoo.models.family_rules import MIXED_FAMILIES, MOE_FAMILIES
from megazoo.models.registry import build_model, family
from megazoo.parallel import collectives as C
from megazoo.parallel.topology import LayoutError

from megazoo.training.config.flags import ArgumentError, to_run_config
from megazoo.training.config.parser import build_parser
from megazoo.training.checkpoint.tokenizer import check_run_tokenizer
from megazoo.training.checkpoint.format import CheckpointError, candidates, read_meta
from megazoo.training.monitor.journal import LogWriteError
from megazoo.training.resilience.health import RunHalted
from megazoo.training.run.loop import pretrain
from megazoo.training.run.stop import exit_code
from megazoo.training.checkpoint.storage import SaveLockError

logger = logging.getLogger("megazoo.train")
# Raised by a run for something the user can fix (the message names the file or flag): no traceback.
# A damaged checkpoint, a held --save, a run that makes no progress and foreign data are among them.
USER_ERRORS = (ArgumentError, LayoutError, TokenizerError, IndexedDatasetError, CheckpointError,
               FileNotFoundError, SaveLockError, RunHalted, VocabularyMismatch)
SILENT_RANK_WAIT_S = 10.0  # how long a rank that says nothing waits for rank 0 to fail (_fail)


def build_run_tokenizer(args):
    """The run's tokenizer (its vocabulary size and end-of-document id), or None for mock data."""
    if args.mock_data and not (args.vocab_file or args.tokenizer_model) and \
            args.tokenizer_type != "NullTokenizer":
        return None
    from megazoo.data.tokenizers import build_tokenizer
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)


def loaded_model(load: str | None):
    """The model config --load's checkpoint records (the one a resume reads first), or None
    without --load or while it holds no checkpoint yet (a run that --save's there later)."""
    for folder in candidates(load) if load else ():
        try:
            fields = read_meta(folder).get("model")
        except CheckpointError:  # damaged: the resume falls back past it, and says so
            continue
        if fields is not None:
            return TransformerConfig.from_saved(fields)
    return None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fail(message: str, code: int, every_rank: bool = False, silent: bool = False):
    """One line on stderr (rank 0 only, unless the error may be this rank's alone; none when
    `silent`: another rank says it), then exit."""
    if not silent and (every_rank or _rank() == 0):
        prefix = f"error (rank {_rank()})" if every_rank and "WORLD_SIZE" in os.environ else "error"
        sys.stderr.write(f"{prefix}: {message}\n")
        sys.stderr.flush()
    elif "WORLD_SIZE" in os.environ:
        # torchrun stops every worker when the first one exits: a silent rank leaving first could
        # cut rank 0 off before its line is written, so it waits (torchrun ends the wait as soon
        # as rank 0 has failed; the bound only matters if rank 0 did not fail alike)
        time.sleep(SILENT_RANK_WAIT_S)
    sys.exit(code)


def check_script_family(run_family: str | None, default_family: str) -> None:
    """A training script trains models of its kind: an MoE script MoE families, a dense one dense
    families, either script a family that mixes dense and MoE layers (Nemotron-H); a config no
    family describes is refused (it could not be exported or resumed by family)."""
    if run_family is None:
        raise ArgumentError("the model flags describe no registered family "
                            "(models/family_rules.py); give a preset with --model or flags of "
                            "one family")
    moe = default_family in MOE_FAMILIES
    if run_family not in MIXED_FAMILIES and (run_family in MOE_FAMILIES) != moe:
        script = os.path.basename(sys.argv[0]) or "this script"
        raise ArgumentError(f"{script} trains {'mixture-of-experts' if moe else 'dense'} families; "
                            f"the model is family {run_family!r}: "
                            + ("give --num-experts or an MoE preset (--model moe-tiny)" if moe
                               else "train it with train_moe.py"))


def main(default_family: str, argv=None):
    """Run the training script of `default_family` (models/registry.py): its default preset
    unless --model names another; every chunk is built by the registry from the config's family."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if _rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)  # one voice: rank 0 logs, others warn
    try:  # before any process group: every rank sees the same error, rank 0 says it
        args = build_parser(family(default_family, "main").default_preset).parse_args(argv)
        tok = build_run_tokenizer(args)
        run = to_run_config(args, vocab_size=tok.vocab_size if tok else None,
                            eod_token=tok.eod if tok else None, loaded=loaded_model(args.load),
                            pad_mask_token=loss_pad_id(tok) if tok else None)
        check_script_family(run.model.family, default_family)
        if tok is not None:  # same vocabulary size is not the same tokenizer
            check_run_tokenizer(tok, run.data, run.checkpoint)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e), 2)
    except KeyboardInterrupt:
        sys.exit(exit_code(2))
    try:
        result = pretrain(build_model, run)
        # leave together: a gloo rank torn down while a peer is still connected aborts
        # ("terminate called without an active exception")
        C.barrier(C.world())
    except LogWriteError as e:  # a full disk under the run log: the rank(s) that failed say so
        _fail(str(e), 1, every_rank=True, silent=not e.here)
    except USER_ERRORS as e:  # after the groups exist, a file may be missing on one rank only
        _fail(str(e), 1, every_rank=True)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over the signal
        _fail("interrupted before training started", exit_code(2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.checkpoint and _rank() == 0:
        logger.info("checkpoint: %s  (resume: %s)", result.checkpoint, resume_hint(run))
    if result.stop_signal:
        sys.exit(exit_code(result.stop_signal))
    return result


def resume_hint(run) -> str:
    """How to resume from --save: what to change in the command that just ran."""
    ckpt = run.checkpoint
    save, load = ckpt.save, ckpt.load
    if load == save and not ckpt.finetune:
        return f"run the same command (its --load {save} resumes)"
    steps = [f"add --load {save}" if load is None else
             f"replace --load {load} with --load {save}" if load != save else None,
             "drop --finetune" if ckpt.finetune else None]
    change = " and ".join(s for s in steps if s)
    grpo = run.grpo
    if grpo is not None and grpo.reference and grpo.reference == load:
        change += f" (keep the KL reference with --grpo-reference {load})"
    return change + " in the same command"
