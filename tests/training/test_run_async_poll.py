"""--async-save's per-iteration commit poll (an all-reduce, then the commit's agreements) runs
inside a watchdog phase, so a rank frozen there is named; with no save in flight nothing is
armed."""
from types import SimpleNamespace

from megazoo.training.resilience.watchdog import CollectiveWatchdog
from megazoo.training.run.trainer import Trainer


class _Store:
    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value


class _Writer:
    def __init__(self, watchdog, in_flight):
        self.watchdog, self.in_flight, self.seen = watchdog, in_flight, []

    def poll(self):
        self.seen.append(self.watchdog._armed)


def test_the_commit_poll_is_watched():
    dog = CollectiveWatchdog(60, rank=0, world_size=2, store=_Store(), start_threads=False,
                             clock=lambda: 0.0)
    for in_flight in (None, 5):
        writer = _Writer(dog, in_flight)
        trainer = SimpleNamespace(writer=writer, watchdog=dog, state=SimpleNamespace(iteration=7),
                                  run=SimpleNamespace(checkpoint=SimpleNamespace(save=None,
                                                                                 save_interval=0)))
        Trainer.save_if_due(trainer, stopping=False)
        if in_flight is None:
            assert writer.seen == [] and dog.seq == 0  # nothing in flight: no poll, nothing armed
        else:
            assert len(writer.seen) == 1 and writer.seen[0] is not None
            assert "commit poll" in writer.seen[0].what and not writer.seen[0].patient
            assert dog._armed is None  # disarmed after the poll
