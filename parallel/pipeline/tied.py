"""Keep the tied word embedding identical on the first and last pipeline stage.

With pp > 1 the embedding (first stage) and the output head (last stage) are two parameters
holding the same matrix; both are marked `spec_of(param).tied_embedding`. They start equal
(broadcast from the first stage) and stay equal because, before every optimizer step, each
receives the sum of both gradients (the gradient sync all-reduces their buckets over the
embedding group: `parallel/zero/grad_sync.py`), which is exactly the gradient of the one shared
matrix in the unsplit model.
Ranks between the two stages hold neither and take no part.
"""
from __future__ import annotations

import torch
from torch import nn

from megazoo.parallel import collectives as C

from megazoo.parallel.param_spec import spec_of
from megazoo.parallel.topology import ParallelTopology


def tied_parameters(chunks: list[nn.Module]) -> list[torch.nn.Parameter]:
    """This rank's tied-embedding parameters, in chunk then registration order.

    The first stage has the embedding in chunk 0 and the last stage the head in its last chunk,
    one each, so the lists on both ends line up.
    """
    return [p for c in chunks for p in c.parameters() if spec_of(p).tied_embedding]


def embedding_group(topo: ParallelTopology):
    # SINGLE when pp == 1 (one module holds one shared parameter) and on middle stages.
    return topo.embedding_group


def broadcast_tied_embedding(chunks: list[nn.Module], topo: ParallelTopology) -> None:
    """Copy the first stage's embedding into the last stage's head (at initialisation)."""
    group = embedding_group(topo)
    with torch.no_grad():
        for p in tied_parameters(chunks):
            C.broadcast(p.data, group, src=0)  # group rank 0: the first stage
