"""Bad values are refused in one line before any process group, model or data exists, and a changed
--seq-length on resume is refused before step 1."""
import pytest

from tests.helpers import TINY, pretrain_gpt
from megazoo.training.config.flags import ArgumentError, to_run_config
from megazoo.training.config.parser import build_parser


@pytest.mark.parametrize("extra, match", [
    (["--micro-batch-size", "0"], r"--micro-batch-size must be >= 1, got 0"),
    (["--log-interval", "0"], r"--log-interval must be >= 1, got 0"),
    (["--train-iters", "-5"], r"--train-iters must be >= 1, got -5"),
    (["--lr", "-1"], r"--lr must be a finite number >= 0, got -1.0"),
    (["--lr", "nan"], r"--lr must be a finite number >= 0, got nan"),
    (["--save-interval", "0"], r"--save-interval must be >= 1"),
    (["--keep-last", "0"], r"--keep-last must be >= 1"),
    (["--keep-every", "5"], r"--keep-every K only refines --keep-last N"),
    (["--max-bad-steps", "0"], r"--max-bad-steps must be >= 1"),
    (["--collective-timeout", "-1"], r"--collective-timeout must be a finite number >= 0"),
    (["--adam-beta2", "1.5"], r"--adam-beta2 must be in \[0, 1\)"),
    (["--data-path", "nan", "a", "0.5", "b"], r"--data-path weight 'nan' of a must be a finite number >= 0"),
    (["--data-path", "inf", "a", "0.5", "b"], r"--data-path weight 'inf' of a must be a finite number >= 0"),
    (["--data-path", "0.3", "a", "0.7"], r"--data-path has 3 items; a blend alternates weights and prefixes"),
    (["--data-path", "0", "a", "0", "b"], r"--data-path weights \[0.0, 0.0\] are all zero"),
])
def test_bad_values_are_refused_in_one_line(extra, match):
    argv = TINY + ["--train-iters", "1"] + extra
    with pytest.raises(ArgumentError, match=match) as e:
        to_run_config(build_parser().parse_args(argv), world_size=1)
    assert "\n" not in str(e.value)


def test_changed_seq_length_on_resume_is_refused(tmp_path):
    from megazoo.training.checkpoint.format import CheckpointError
    pretrain_gpt(TINY + ["--train-iters", "1", "--save", str(tmp_path)], 1)
    longer = [a if a != "16" else "8" for a in TINY]  # --seq-length 8 (and max positions 8)
    with pytest.raises(CheckpointError, match=r"--seq-length 8 differs from 16 in .*iter_0000001: the "
                                              r"saved data position counts 16-token samples; pass "
                                              r"--seq-length 16, or --finetune"):
        pretrain_gpt(longer + ["--train-iters", "2", "--load", str(tmp_path)], 1)
