import pytest
import torch

from megazoo.parallel.random import TP_STREAM, RNGStreams


def test_fork_unknown_stream_names_the_known_ones():
    streams = RNGStreams()
    streams.add(TP_STREAM, 3)
    with pytest.raises(ValueError, match=r"no RNG stream 'tensor-paralel'; known streams: \['tensor-parallel'\]"):
        with streams.fork("tensor-paralel"):
            pass
    before = torch.get_rng_state()
    with streams.fork(TP_STREAM):  # the registered stream draws without moving the default one
        torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)
