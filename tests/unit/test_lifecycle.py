"""The worker's background services share one lifecycle: started in order, stopped in reverse,
and one that fails to stop does not keep the others running."""

from __future__ import annotations

import pytest

from layertap.worker.ops.lifecycle import ServiceGroup


class Recorder:
    def __init__(self, name: str, log: list[str], fail_start: bool = False, fail_stop: bool = False):
        self.name, self.log, self.fail_start, self.fail_stop = name, log, fail_start, fail_stop

    def start(self) -> Recorder:
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")
        self.log.append(f"start {self.name}")
        return self

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.fail_stop:
            raise RuntimeError(f"{self.name} cannot stop")


def test_started_in_order_stopped_in_reverse_past_a_broken_stop():
    log: list[str] = []
    group = ServiceGroup([Recorder("heartbeat", log), Recorder("watchdog", log, fail_stop=True),
                          Recorder("progress", log)])
    group.start()
    group.stop()
    assert log == ["start heartbeat", "start watchdog", "start progress",
                   "stop progress", "stop watchdog", "stop heartbeat"]
    group.stop()  # stopping twice stops nothing twice
    assert len(log) == 6


def test_a_failed_start_leaves_only_the_started_to_stop():
    log: list[str] = []
    group = ServiceGroup([Recorder("heartbeat", log), Recorder("reconciler", log, fail_start=True),
                          Recorder("progress", log)])
    with pytest.raises(RuntimeError):
        group.start()
    group.stop()
    assert log == ["start heartbeat", "stop heartbeat"]
