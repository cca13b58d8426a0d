"""Forward passes for evaluation on a model of any tensor/pipeline layout: per-token
log-probabilities of given targets and the greedy next token at every position.

Every rank calls `Scorer.run` with the same sequences (a collective); each call runs one
forward-only pipeline pass per batch of `batch_size` sequences, right-padded to the batch's
longest (rounded up to a multiple of tp, so sequence parallelism splits it). The last stage
gathers the vocabulary shards into full logits and takes a float32 log-softmax (what a
single-device model computes); the results travel to every rank of the pipeline, so every
rank returns the same numbers. Nothing here draws a random number or changes the chunks' mode
for longer than the call.
"""
from __future__ import annotations

import torch

from megazoo.models.language_model import gather_logits
from megazoo.parallel import collectives as C
from megazoo.parallel.pipeline.engine import run_pipeline
from megazoo.parallel.pipeline.schedules import build_schedule


class Scorer:
    def __init__(self, chunks, topo, batch_size: int = 8):
        if topo.cp > 1:
            raise ValueError("evaluation runs at --context-parallel-size 1 (padded variable-length "
                             "sequences are not split across context-parallel ranks)")
        self.chunks, self.topo, self.batch_size = chunks, topo, max(int(batch_size), 1)
        self.config = chunks[0].config
        self.dtype = self.config.dtype

    @property
    def max_length(self) -> int:
        return self.config.max_position_embeddings

    def run(self, inputs: list[list[int]], targets: list[list[int]] | None = None):
        """(log-probabilities of targets[i][j] after inputs[i][:j+1] (None without targets),
        greedy token after inputs[i][:j+1]) per sequence, as Python lists."""
        logps, greedy = [], []
        for start in range(0, len(inputs), self.batch_size):
            part = inputs[start:start + self.batch_size]
            tgt = targets[start:start + self.batch_size] if targets is not None else None
            lp, gr = self._batch(part, tgt)
            for i, seq in enumerate(part):
                n = len(seq)
                logps.append(lp[i, :n].tolist() if tgt is not None else None)
                greedy.append(gr[i, :n].tolist())
        return logps, greedy

    @torch.no_grad()
    def _batch(self, inputs, targets):
        topo, device = self.topo, self.topo.device
        if any(not s for s in inputs):
            raise ValueError("evaluation: an empty input sequence")
        longest = max(len(s) for s in inputs)
        if longest > self.max_length:
            raise ValueError(f"evaluation: a sequence of {longest} tokens exceeds the model's "
                             f"{self.max_length} positions")
        tp = topo.tp if topo.sequence_parallel else 1
        length = -(-longest // tp) * tp
        b = len(inputs)
        tokens = torch.zeros(b, length, dtype=torch.long, device=device)
        labels = torch.zeros(b, length, dtype=torch.long, device=device)
        for i, s in enumerate(inputs):
            tokens[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            if targets is not None:
                labels[i, :len(targets[i])] = torch.tensor(targets[i], dtype=torch.long)
        out = torch.zeros(2, b, length, dtype=torch.float32, device=device)
        vocab = self.config.vocab_size

        def forward_fn(chunk, x, mb):
            h = chunk(mb["tokens"] if chunk.pre_process else x)
            if not chunk.post_process:
                return h
            logp = torch.log_softmax(gather_logits(h, topo, vocab).float(), dim=-1)
            out[0] = logp.gather(-1, mb["labels"][..., None]).squeeze(-1)
            out[1] = logp.argmax(-1).float()
            return logp.new_zeros(())

        seq = length // tp
        steps = build_schedule("forward_only", topo.pp, topo.pp_rank, 1, vpp=len(self.chunks))
        modes = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()
        try:
            run_pipeline(steps, self.chunks, [{"tokens": tokens, "labels": labels}], topo,
                         (seq, b, self.config.hidden_size), self.dtype, forward_fn)
        finally:
            for c, mode in zip(self.chunks, modes):
                c.train(mode)
        C.broadcast(out, topo.pp_group, src=topo.pp - 1)  # the last stage's results, everywhere
        return out[0], out[1].long()
