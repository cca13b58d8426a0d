"""Checkpoint format rules: copies of one tensor that must be equal (replicated over TP ranks, the
tied embedding on two pipeline stages) are taken when equal and refused, in one line, when not;
meta.json records known types only."""
import pytest
import torch

from megazoo.training.checkpoint import reshard
from megazoo.training.checkpoint.format import CheckpointError


def _assemble(copies: list[torch.Tensor]):
    # one replicated (dim -1) 2 x 3 tensor on one stage, held by len(copies) TP ranks
    parts = {"model.0.norm.weight": {(0, 0, r, 0): t for r, t in enumerate(copies)}}
    info = {"model.0.norm.weight": [{(0, 0): (2, 3)}, -1, 3, len(copies), None, 1]}
    return reshard._assemble(parts, info, "ckpt/iter_0000002")


def test_equal_replicas_are_taken():
    t = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(_assemble([t, t.clone()])["model.0.norm.weight"], t)


def test_diverged_replicas_are_refused_naming_tensor_and_difference():
    t = torch.arange(6.0).reshape(2, 3)
    drifted = t.clone()
    drifted[1, 2] += 0.25
    with pytest.raises(CheckpointError, match=r"^ckpt/iter_0000002: model\.0\.norm\.weight across "
                       r"tensor-parallel ranks: 2 copies that must be equal differ by up to 0\.25;"):
        _assemble([t, drifted])


def test_meta_json_takes_known_types_only(tmp_path):
    import json
    import os

    from megazoo.models.config import TransformerConfig
    from megazoo.training.checkpoint import format as ckpt
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=11)
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 1) + ".tmp")
    ckpt.commit(str(tmp_path), 1, 0, dict(model=cfg, dtype=torch.bfloat16))
    with open(os.path.join(ckpt.iteration_dir(str(tmp_path), 1), "meta.json")) as f:
        meta = json.load(f)
    assert meta["model"]["hidden_size"] == 8 and meta["dtype"] == "torch.bfloat16"
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 2) + ".tmp")
    with pytest.raises(TypeError, match=r"meta.json cannot record PosixPath .*: give it as a number"):
        ckpt.commit(str(tmp_path), 2, 0, dict(folder=tmp_path))
