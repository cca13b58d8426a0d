"""What a run tells its user to type next: the resume line after training, and --reward's
module lookup (a file in the working directory imports, as TRL's scripts import their rewards)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest


def _run(save, load=None, finetune=False, reference=None):
    grpo = SimpleNamespace(reference=reference) if reference is not None else None
    return SimpleNamespace(checkpoint=SimpleNamespace(save=save, load=load, finetune=finetune),
                           grpo=grpo)


def test_resume_hint_names_what_to_change():
    from megazoo.training.run.entry import resume_hint
    assert resume_hint(_run("ckpt")) == "add --load ckpt in the same command"
    assert resume_hint(_run("ckpt", load="ckpt")) == "run the same command (its --load ckpt resumes)"
    assert resume_hint(_run("ckpt/chat", load="ckpt/smol", finetune=True)) == \
        "replace --load ckpt/smol with --load ckpt/chat and drop --finetune in the same command"
    assert resume_hint(_run("ckpt", load="ckpt", finetune=True)) == "drop --finetune in the same command"
    assert resume_hint(_run("runs/grpo", load="ckpt/smol", finetune=True, reference="ckpt/smol")) == \
        ("replace --load ckpt/smol with --load runs/grpo and drop --finetune (keep the KL reference "
         "with --grpo-reference ckpt/smol) in the same command")


@pytest.fixture
def clean_imports(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in [n for n in sys.modules if n.split(".")[0] in ("docaudit_reward", "docaudit_pkg")]:
        del sys.modules[name]


def test_reward_module_from_the_working_directory(clean_imports):
    from megazoo.training.run.grpo_online import load_rewards
    (clean_imports / "docaudit_reward.py").write_text(
        "def my_reward(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n")
    (clean_imports / "docaudit_pkg" / "sub").mkdir(parents=True)
    (clean_imports / "docaudit_pkg" / "sub" / "r.py").write_text(
        "def two(prompts, completions, **kw):\n    return [2.0 for _ in completions]\n")
    fns = load_rewards("docaudit_reward:my_reward, docaudit_pkg.sub.r:two")
    assert [f(prompts=["p"], completions=["c"]) for f in fns] == [[1.0], [2.0]]
    assert str(clean_imports) not in sys.path  # found there without editing sys.path


def test_missing_reward_module_is_one_line_naming_the_flag(clean_imports):
    from megazoo.training.run.grpo_online import load_reward
    with pytest.raises(ValueError, match=r"--reward 'no_such_reward_module:f': No module named "
                                         r"'no_such_reward_module' \(the module is imported by name"):
        load_reward("no_such_reward_module:f")
    assert str(clean_imports) not in sys.path


def test_a_reward_argument_no_record_has_is_refused_before_sampling():
    from megazoo.training.run.grpo_online import check_reward_fields

    def sum_digit(prompts, completions, answer, **kw):
        return [0.0] * len(completions)

    def optional(prompts, completions, answer=None, **kw):
        return [0.0] * len(completions)

    records = [{"prompt": "1 + 2 ="}, {"prompt": "3 + 4 =", "total": 7}]
    check_reward_fields([optional, len], records, "p.jsonl")  # a default, a builtin: nothing to check
    check_reward_fields([sum_digit], records + [{"prompt": "x", "answer": 1}], "p.jsonl")
    with pytest.raises(ValueError, match=r"--reward .*:sum_digit needs 'answer', a field no record of "
                                         r"--grpo-prompts p.jsonl has"):
        check_reward_fields([optional, sum_digit], records, "p.jsonl")
