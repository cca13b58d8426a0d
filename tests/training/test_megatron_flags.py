"""A Megatron-LM launch script runs unchanged: its flags parse, the ones megazoo implements change
behaviour (checked here), the aliases say in one log line what megazoo does instead."""
import logging
import time

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import TINY, pretrain_gpt
from megazoo.training.config.flags import ArgumentError, to_run_config

# Megatron-LM's examples/pretrain_gpt.sh (GPT-2 345M), plus the flags of its distributed launch.
from megazoo.training.config.parser import build_parser

# Megatron-LM's examples/pretrain_gpt.sh (GPT-2 345M), plus the flags of its distributed launch.
MEGATRON_345M = """--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
    --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --lr 0.00015
    --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
    --lr-warmup-fraction .01 --clip-grad 1.0 --fp16 --data-path my-gpt2_text_document
    --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --split 949,50,1 --log-interval 100
    --save-interval 10000 --eval-interval 1000 --eval-iters 10 --distributed-backend nccl
    --save ckpt --load ckpt --use-distributed-optimizer --overlap-grad-reduce --use-flash-attn""".split()


def test_megatron_345m_launch_parses_unchanged(caplog):
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        run = to_run_config(build_parser().parse_args(MEGATRON_345M), vocab_size=50257, world_size=1)
    m, s = run.model, run.schedule
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, run.data.seq_length) == (24, 1024, 16, 1024)
    assert (s.micro_batch_size, s.global_batch_size, s.train_iters, s.lr_decay_iters) == (4, 8, 500000, 320000)
    assert s.lr_warmup_iters == 3200  # .01 x --lr-decay-iters, as Megatron computes it
    assert run.optimizer.zero_stage == 1 and run.model.params_dtype == "float16"
    assert run.data.split == "949,50,1" and run.checkpoint.save == run.checkpoint.load == "ckpt"
    lines = [r.getMessage() for r in caplog.records]
    for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce", "--use-flash-attn",
                 "--distributed-backend"):
        assert sum(line.startswith(flag) for line in lines) == 1, (flag, lines)


def _config(*extra, world=1, **kw):
    return to_run_config(build_parser().parse_args(TINY + ["--train-iters", "10", *extra]), world_size=world, **kw)


def test_compat_flags_map_and_refuse():
    assert _config("--zero-stage", "2", "--use-distributed-optimizer").optimizer.zero_stage == 2
    assert _config().optimizer.zero_stage == 0
    assert _config("--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.3").schedule.lr_warmup_iters == 3
    c = _config("--exit-interval", "4", "--exit-duration-in-mins", "2", "--num-workers", "3", "--no-load-optim",
                "--no-load-rng", "--log-throughput", "--eod-mask-loss", eod_token=60)
    assert (c.schedule.exit_interval, c.schedule.exit_duration_mins, c.data.num_workers) == (4, 2.0, 3)
    assert (c.checkpoint.load_optim, c.checkpoint.load_rng, c.logging.log_throughput) == (False, False, True)
    assert c.data.eod_mask_token == 60
    for extra, match in [(["--seq-len", "8"], "unrecognized arguments: --seq-len"),  # allow_abbrev=False
                         (["--eod-mask-loss"], "--eod-mask-loss needs a tokenizer"),
                         (["--lr-warmup-fraction", "0.1"], "give one of"),  # TINY has --lr-warmup-iters 2
                         (["--exit-interval", "0"], "--exit-interval must be >= 1"),
                         (["--distributed-backend", "mpi"], "invalid choice"),
                         (["--data-path", "corpus_text_document.bin"],
                          "--data-path corpus_text_document.bin: give the prefix without the suffix, "
                          "--data-path corpus_text_document$")]:
        with pytest.raises(ArgumentError, match=match):
            _config(*extra)


def test_every_flag_has_help_and_shows_its_default():
    p = build_parser()
    assert [a.option_strings for a in p._actions if not a.help] == []
    text = p.format_help()
    assert "--micro-batch-size MICRO_BATCH_SIZE" in text and "(default: 1)" in text and "(default: 0.0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_null_tokenizer():
    from megazoo.data.tokenizers import TokenizerError, build_tokenizer
    tok = build_tokenizer("NullTokenizer", vocab_size=60)
    assert (tok.vocab_size, tok.eod, tok.encode("3 5 59"), tok.decode([3, 5])) == (61, 60, [3, 5, 59], "3 5")
    with pytest.raises(TokenizerError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")


def test_read_ahead_workers_and_eod_mask():
    from megazoo.training.run.batches import MockGPTDataset, microbatches
    ds = MockGPTDataset(50, 16, 7, seed=3)
    kw = dict(consumed_samples=6, micro_batch_size=2, dp_rank=1, dp=2, device=torch.device("cpu"))
    plain, ahead = microbatches(ds, **kw), microbatches(ds, num_workers=3, eod_mask_token=6, **kw)
    for _ in range(30):  # wraps around the 50 samples
        a, b = next(plain), next(ahead)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])
        assert torch.equal(b["loss_mask"], (b["tokens"] != 6).float())
    ahead.close()
    from megazoo.training.run.step import make_forward_fn

    class Last(torch.nn.Module):
        pre_process, post_process = True, True

        def forward(self, tokens, labels):
            return tokens.float()  # the "per-token loss" is the token id

    mb = {"tokens": torch.tensor([[1, 6, 3]]), "labels": torch.zeros(1, 3), "loss_mask": torch.tensor([[1., 0, 1]])}
    assert make_forward_fn()(Last(), None, mb).item() == 2.0  # (1 + 3) / 2: the eod position left out


def test_stop_requests_exit_interval_and_duration():
    from megazoo.training.run.stop import StopRequests
    cpu = torch.device("cpu")
    stops = StopRequests(exit_interval=4)
    assert stops.agreed(3, cpu) == (0, "") and stops.agreed(8, cpu) == (0, "--exit-interval 4")
    timed = StopRequests(exit_duration_mins=1e-4)
    time.sleep(0.01)
    assert timed.agreed(1, cpu)[1].startswith("--exit-duration-in-mins")


def _load_flags_worker(rank, root):
    argv = TINY + ["--hidden-dropout", "0.1", "--zero-stage", "1"]
    straight = pretrain_gpt(argv + ["--train-iters", "6"], 2)
    first = pretrain_gpt(argv + ["--train-iters", "6", "--exit-interval", "3", "--save", root], 2)
    no_optim = pretrain_gpt(argv + ["--train-iters", "6", "--load", root, "--no-load-optim"], 2)
    no_rng = pretrain_gpt(argv + ["--train-iters", "6", "--load", root, "--no-load-rng"], 2)
    return straight.losses, first, no_optim.losses, no_rng.losses


def test_exit_interval_and_load_without_optimizer_or_rng(tmp_path):
    straight, first, no_optim, no_rng = run_distributed(_load_flags_worker, 2, str(tmp_path), timeout=300)[0]
    assert first.state.iteration == 3 and first.stop_signal == 0 and first.checkpoint.endswith("iter_0000003")
    assert first.losses == straight[:3]
    # Fresh Adam moments: the first resumed step's loss (same weights, data, dropout) is the same,
    # the update differs.
    assert len(no_optim) == 3 and no_optim[0] == straight[3] and no_optim[1] != straight[4]
    assert len(no_rng) == 3 and no_rng[0] != straight[3]  # other dropout masks


def test_log_line_and_throughput_flag(caplog):
    from megazoo.training.config.run_config import LoggingConfig
    from megazoo.training.monitor.journal import RunJournal
    from megazoo.training.monitor.console import RunLogger
    metrics = dict(loss=2.123456789, lr=1e-3, consumed_samples=64, ms_per_iter=12.345, tokens_per_s=1e4,
                   tflops_per_rank=1.5)
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        RunLogger(LoggingConfig(), {}, True, RunJournal(None)).log(metrics, 8)
        RunLogger(LoggingConfig(log_throughput=True), {}, True, RunJournal(None)).log(metrics, 8)
    quiet, loud = [r.getMessage() for r in caplog.records]
    assert "loss 2.123457" in quiet and "consumed_samples 64" in quiet and "ms_per_iter 12.3" in quiet
    assert "tokens_per_s" not in quiet and "tokens_per_s 1.0000e+04" in loud and "tflops_per_rank 1.5" in loud


def test_plan_ranks_only_layouts_the_trainer_accepts(capsys):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "plan.py")
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from megazoo.models.presets import preset
    from megazoo.training.planning.planner import Layout, rank_layouts
    from megazoo.training.planning.reference_runs import CLUSTERS
    cfg, cluster = preset("gpt-1.3b"), CLUSTERS["dgx-a100-80gb"].replace(num_gpus=8)
    zero3_pipeline = Layout.of(tp=1, pp=2, dp=4, zero_stage=3, micro_batch_size=1,
                               global_batch_size=64, seq_length=2048)
    assert "--zero-stage 3" in tool.trainer_refusal(cfg, zero3_pipeline)
    assert tool.trainer_refusal(cfg, Layout.of(tp=2, pp=1, dp=4, zero_stage=1, micro_batch_size=1,
                                               global_batch_size=64)) is None
    plans = rank_layouts(cfg, cluster, Layout(global_batch_size=64, seq_length=2048))
    refused = [p for p in plans if tool.trainer_refusal(cfg, p.layout)]
    tool.main(["--model", "gpt-1.3b", "--gpus", "8", "--global-batch-size", "64", "--top", "1000"])
    shown = capsys.readouterr().out
    assert f"{len(plans) - len(refused)} layouts fit" in shown
    assert not any(p.layout.describe() in shown for p in refused)


def test_qwen_shape_flags_map_onto_the_config():
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size",
            "128", "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "1",
            "--mock-data", "--kv-channels", "32", "--add-qkv-bias", "--qk-layernorm",
            "--disable-bias-linear"]
    m = to_run_config(build_parser().parse_args(argv), world_size=1).model
    assert (m.kv_channels, m.head_dim, m.add_qkv_bias, m.qk_layernorm, m.bias) == (32, 32, True, True, False)
    plain = to_run_config(build_parser().parse_args(argv[:-5]), world_size=1).model
    assert (plain.kv_channels, plain.add_qkv_bias, plain.qk_layernorm) == (None, False, False)


# Megatron-LM's everyday switches: kernel fusions and what megazoo does anyway log one line each.
EVERYDAY_ACCEPTED = ["--attention-softmax-in-fp32", "--apply-query-key-layer-scaling", "--use-cpu-initialization",
                     "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                     "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                     "--accumulate-allreduce-grads-in-fp32", "--check-for-nan-in-loss-and-grad",
                     "--override-opt_param-scheduler"]


def test_everyday_megatron_switches_honoured_or_refused(caplog, tmp_path):
    plain = _config()
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        c = _config(*EVERYDAY_ACCEPTED, "--dataloader-type", "single", "--weight-decay-incr-style", "constant")
    lines = [r.getMessage() for r in caplog.records]
    for flag in EVERYDAY_ACCEPTED:
        assert sum(line.startswith(flag + ":") for line in lines) == 1, (flag, lines)
    assert c.model == plain.model and c.schedule == plain.schedule and c.optimizer == plain.optimizer
    # Megatron's other spelling is the same flag: one line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        _config("--override-opt-param-scheduler")
    assert sum("override-opt_param-scheduler" in r.getMessage() for r in caplog.records) == 1
    # --train-iters with --train-samples: refused, as Megatron-LM refuses them together
    with pytest.raises(ArgumentError, match="--train-iters or --train-samples, not both"):
        _config("--train-samples", "80")
    # honoured: selective recompute, squared ReLU
    assert _config("--recompute-activations").model.recompute_granularity == "selective"
    assert plain.model.recompute_granularity is None
    relu2 = _config("--squared-relu").model
    assert relu2 == plain.model.replace(activation="relu2") and plain.model.activation != "relu2"
    _check_squared_relu_mlp(relu2)
    # --exit-on-missing-checkpoint: refused before any work when --load holds nothing ...
    with pytest.raises(ArgumentError, match=f"--exit-on-missing-checkpoint: --load {tmp_path} holds no checkpoint"):
        _config("--load", str(tmp_path), "--exit-on-missing-checkpoint")
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "meta.json").write_text("{}")
    # ... and passes once it holds one
    assert _config("--load", str(tmp_path), "--exit-on-missing-checkpoint").checkpoint.load == str(tmp_path)
    refusals = [(["--recompute-activations", "--recompute-granularity", "full"],
                 "--recompute-activations \\(selective recompute\\) contradicts --recompute-granularity full"),
                (["--squared-relu", "--swiglu"], "--squared-relu contradicts --swiglu"),
                (["--dataloader-type", "cyclic"], "--dataloader-type cyclic: .*give single"),
                (["--dataloader-type", "external"], "--dataloader-type external: .*give single"),
                (["--weight-decay-incr-style", "linear"], "--weight-decay-incr-style linear: .*give constant"),
                (["--start-weight-decay", "0.1"], "--start-weight-decay 0.1: a weight-decay schedule"),
                (["--end-weight-decay", "0.1"], "--end-weight-decay 0.1: a weight-decay schedule"),
                (["--use-checkpoint-opt-param-scheduler"], "--use-checkpoint-opt_param-scheduler: megazoo's "
                                                           "checkpoints hold no learning-rate schedule"),
                (["--no-save-optim"], "--no-save-optim: megazoo's checkpoints always hold"),
                (["--no-save-rng"], "--no-save-rng: megazoo's checkpoints always hold"),
                (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
                 "--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16")]
    for extra, match in refusals:
        with pytest.raises(ArgumentError, match=match):
            _config(*extra)
    # the command line Megatron-LM itself trained the golden checkpoint with (its kernel switches
    # included) parses unchanged into the same Llama shape
    from tests.fixtures.megatron_lm.make_golden import TRAIN_FLAGS
    golden = to_run_config(build_parser().parse_args(TRAIN_FLAGS), world_size=1).model
    assert (golden.num_layers, golden.hidden_size, golden.num_query_groups, golden.ffn_hidden_size) == (2, 32, 2, 40)
    assert (golden.activation, golden.normalization, golden.bias, golden.tie_word_embeddings) == \
        ("swiglu", "rmsnorm", False, False)
    # a command line's refusals come together, one line each
    with pytest.raises(ArgumentError) as e:
        _config("--no-save-optim", "--no-save-rng", "--dataloader-type", "cyclic")
    assert "3 refusals" in str(e.value)


def _check_squared_relu_mlp(cfg):
    """The MLP the --squared-relu config builds is fc2(relu(fc1(x))^2), by hand on its own weights."""
    from tests.helpers import topology
    from megazoo.models.init import Initializer
    from megazoo.models.mlp import ParallelMLP
    F = torch.nn.functional
    mlp = ParallelMLP(cfg, topology(), Initializer(cfg), "layers.0.mlp.")
    x = torch.randn(5, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = F.relu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)).square()
    torch.testing.assert_close(mlp(x), F.linear(hidden, mlp.fc2.weight, mlp.fc2.bias), rtol=0, atol=0)


def test_per_split_data_flags_files_and_refusals(tmp_path, caplog):
    """--train/valid/test-data-path, --data-args-path and --per-split-data-args-path read as
    Megatron-LM's get_blend_and_blend_per_split reads them; contradictions refused in one line; the
    vocabulary check and the tokenizer check see every prefix of every split."""
    import json

    import numpy as np

    from megazoo.data.indexed import IndexedDatasetBuilder
    from megazoo.data.token_stats import VocabularyMismatch
    from megazoo.training.checkpoint.tokenizer import data_prefixes
    from megazoo.training.run.batches import build_datasets
    base = [a for a in TINY if a != "--mock-data"] + ["--train-iters", "10"]

    def config(*extra):
        return to_run_config(build_parser().parse_args(base + list(extra)), world_size=1)

    data = config("--train-data-path", "0.3", "a", "0.7", "b", "--valid-data-path", "v").data
    assert data.per_split == (["0.3", "a", "0.7", "b"], ["v"], None) and data.data_path == []
    assert data_prefixes(data) == ["a", "b", "v"]
    (tmp_path / "blend.txt").write_text("0.3 a\n 0.7   b\n")
    data = config("--data-args-path", str(tmp_path / "blend.txt"), "--split", "98,2,0").data
    assert (data.data_path, data.split, data.per_split) == (["0.3", "a", "0.7", "b"], "98,2,0", None)
    (tmp_path / "splits.json").write_text(json.dumps({"train": "0.3 a 0.7 b", "valid": [1, "v"], "test": None}))
    data = config("--per-split-data-args-path", str(tmp_path / "splits.json")).data
    assert data.per_split == (["0.3", "a", "0.7", "b"], ["1", "v"], None)
    (tmp_path / "no_test.json").write_text(json.dumps({"train": ["a"], "valid": None}))
    (tmp_path / "bad.json").write_text("{train: a}")
    (tmp_path / "empty.txt").write_text("\n")
    for extra, match in [
            (["--data-path", "a", "--train-data-path", "b"],
             "--data-path and --train/valid/test-data-path name the data twice"),
            (["--data-path", "a", "--data-args-path", str(tmp_path / "blend.txt")], "--data-path and --data-args-path"),
            (["--data-args-path", str(tmp_path / "blend.txt")], "give --split too"),
            (["--data-args-path", str(tmp_path / "empty.txt"), "--split", "1"], "the file is empty"),
            (["--train-data-path", "a", "--per-split-data-args-path", str(tmp_path / "splits.json")],
             "name the splits twice"),
            (["--train-data-path", "a", "--split", "98,2,0"], "megatron-core refuses split with blend_per_split"),
            (["--valid-data-path", "v"], "without a training path: nothing to train on"),
            (["--train-data-path", "a", "--mock-data"], "two data sources"),
            (["--train-data-path", "0.5", "a", "0.5"], "--train-data-path has 3 items"),
            (["--train-data-path", "a", "--valid-data-path", "v.bin"], "--valid-data-path v.bin: give the prefix"),
            (["--per-split-data-args-path", str(tmp_path / "no_test.json")], 'missing test'),
            (["--per-split-data-args-path", str(tmp_path / "bad.json")], "not valid JSON"),
            (["--train-data-path", "a", "--train-weighted-split-paths-path", str(tmp_path / "blend.txt")],
             "two ways to name the splits")]:
        with pytest.raises(ArgumentError, match=match):
            config(*extra)
    # the vocabulary check before step 1 reads the test split's prefix too (never trained on)
    for name, high in (("good", 60), ("bad", 99)):
        builder = IndexedDatasetBuilder(str(tmp_path / name) + ".bin", dtype=np.uint16)
        for i in range(40):
            builder.add_document(high - 1 - (np.arange(12) + i) % 20)
        builder.finalize(str(tmp_path / name) + ".idx")
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    data = config("--train-data-path", good, "--test-data-path", bad).data
    with pytest.raises(VocabularyMismatch, match="bad: token ids span"):
        build_datasets(data, seed=1, vocab_size=61, num_samples=(8, 8, 0))
    data = config("--train-data-path", "1", good, "--data-cache-path", str(tmp_path / "cache")).data
    with caplog.at_level(logging.WARNING):
        train, valid, test = build_datasets(data, seed=1, vocab_size=61, num_samples=(8, 8, 0))
    assert len(train) >= 8 and valid is None and test is None and not hasattr(train, "datasets")
    assert any("no --valid-data-path: evaluation is skipped" in r.getMessage() for r in caplog.records)
