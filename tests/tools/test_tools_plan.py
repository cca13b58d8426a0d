"""tools/plan.py says what it assumes (sequence, batch, dtype, GPU, interconnect) and prints a
torchrun command for its best layout that the reference script accepts as that layout."""
import importlib.util
import os
import shlex

from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

PLAN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "plan.py")
FILLED = {"DATA_PREFIX": "corpus_text_document", "TOKENIZER_FOLDER": "tokenizer",
          "TRAIN_ITERS": "100", "CHECKPOINTS": "ckpt", "MASTER_HOST:29500": "node0:29500"}


def _tool():
    spec = importlib.util.spec_from_file_location("plan_tool", PLAN)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _launch(out: str) -> tuple[list[str], str, list[str]]:
    """(torchrun's arguments, the script, the script's flags, placeholders filled) of the output."""
    text = out[out.index("torchrun"):].replace("\\\n", " ")
    words = [FILLED.get(w, w) for w in shlex.split(text.splitlines()[0])]
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[1:script], words[script], words[script + 1:]


def test_assumptions_and_a_launch_command_the_trainer_accepts(capsys):
    tool = _tool()
    tool.main(["--model", "gpt-1.3b", "--gpus", "8", "--global-batch-size", "64", "--top", "1"])
    out = capsys.readouterr().out
    assert out.startswith("assumptions: sequence 2048 tokens (default; set with --seq-length); "
                          "global batch 64 sequences (--global-batch-size); bf16 weights and "
                          "activations, fp32 master weights, 32-bit gradients (default; set with "
                          "--precision, --grad-bytes); GPU: 80 GiB (90% usable), 312 TFLOP/s dense "
                          "16-bit peak, 8 per node (dgx-a100-80gb;"), out
    assert "interconnect: 230 GB/s per GPU inside a node, 25.0 GB/s per GPU across nodes" in out
    best = out.split("\n")[4].split(" ")[0:6]  # the first row of the ranking
    launcher, script, flags = _launch(out)
    assert launcher == ["--nproc-per-node", "8"] and script == "train_gpt.py"
    run = to_run_config(build_parser(None).parse_args(flags), world_size=8)
    p, s = run.parallel, run.schedule
    got = f"tp{p.tp} pp{p.pp} dp{8 // (p.tp * p.pp)}"
    assert " ".join(best[:3]) == got, (best, got)
    assert (run.data.seq_length, s.global_batch_size, run.model.params_dtype,
            run.model.num_parameters()) == (2048, 64, "bfloat16", tool.preset("gpt-1.3b",
                                            max_position_embeddings=2048).num_parameters())
    assert "launch the fastest (the first row, 8 GPUs):\ntorchrun" in out


def test_a_llama_layout_over_nodes_launches_train_llama_with_the_preset(capsys):
    tool = _tool()
    tool.main(["--model", "llama3-8b", "--cluster", "dgx-h100-80gb", "--gpus", "16", "--tp", "2",
               "--pp", "2", "--zero-stage", "1", "--recompute", "selective", "--micro-batch-size",
               "1", "--seq-length", "4096", "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "sequence 4096 tokens (--seq-length); global batch 512 sequences (default; set with " \
           "--global-batch-size)" in out
    launcher, script, flags = _launch(out)
    assert launcher == ["--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "node0:29500"] and script == "train_llama.py"
    run = to_run_config(build_parser("smollm2-135m").parse_args(flags), world_size=16)
    m = run.model
    assert (run.parallel.tp, run.parallel.pp, run.optimizer.zero_stage, m.num_query_groups,
            m.position_embedding, m.normalization, m.ffn_hidden_size, m.recompute_granularity) == \
        (2, 2, 1, 8, "rope", "rmsnorm", 14336, "selective")
    assert run.checkpoint.save == run.checkpoint.load == "ckpt" and run.data.data_path == [
        "corpus_text_document"]
    # --optimizer muon: fewer optimizer bytes (one momentum per hidden matrix), the same weights
    # and gradients, and a launch command whose run config is that optimizer's
    row = out.split("\n")[3].split()  # the layout's row: name, then params grads optim ...
    tool.main(["--model", "llama3-8b", "--cluster", "dgx-h100-80gb", "--gpus", "16", "--tp", "2",
               "--pp", "2", "--zero-stage", "1", "--recompute", "selective", "--micro-batch-size",
               "1", "--seq-length", "4096", "--optimizer", "muon"])
    muon = capsys.readouterr().out
    muon_row = muon.split("\n")[3].split()
    # columns after the layout's name: params grads optim activ GiB step-s TFLOP/s MFU
    assert muon_row[:10] == row[:4] + ["muon"] + row[4:9], (row, muon_row)
    assert muon_row[11] == row[10] and muon_row[13:] == row[12:], (row, muon_row)
    assert float(muon_row[10]) < 0.8 * float(row[9])  # GiB of optimizer states
    run = to_run_config(build_parser("smollm2-135m").parse_args(_launch(muon)[2]), world_size=16)
    assert run.optimizer.optimizer == "muon"
