"""The sampler polls on its own thread, stops on request, and summarises a window."""

from __future__ import annotations

import threading
import time

import pytest

from ivyplug.load import Sampler, ScriptedProbe


class ThreadRecorder:
    name = "recorder"

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.closed = False

    def available(self) -> bool:
        return True

    def read(self) -> dict[str, float]:
        self.threads.add(threading.get_ident())
        return {"x": float(len(self.threads))}

    def close(self) -> None:
        self.closed = True


class Broken(ThreadRecorder):
    name = "broken"

    def read(self) -> dict[str, float]:
        raise OSError("device vanished")


class Unavailable(ThreadRecorder):
    name = "off"

    def available(self) -> bool:
        return False

    def read(self) -> dict[str, float]:
        raise AssertionError("an unavailable probe must not be read")


def wait_for_samples(sampler: Sampler, count: int, timeout: float) -> None:
    """Block until ``sampler`` has taken ``count`` samples; a clear error after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while sampler.samples < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sampler took {sampler.samples} of {count} samples within {timeout} s")
        time.sleep(0.005)


def test_reads_off_the_training_thread_and_stops() -> None:
    rec = ThreadRecorder()
    sampler = Sampler([rec, Unavailable()], interval=0.01)
    try:
        wait_for_samples(sampler, 3, timeout=10)
        assert threading.get_ident() not in rec.threads
        assert sampler.running and sampler.latest() == {"x": 1.0}
    finally:
        sampler.close()
    assert not sampler.running and rec.closed
    count = sampler.samples
    time.sleep(0.05)
    assert sampler.samples == count


def test_default_interval_and_bad_intervals() -> None:
    s = Sampler([], start=False)
    assert s.interval == 1.0 and not s.running
    for bad in (0, -1, float("inf"), "1", True):
        with pytest.raises(ValueError, match="interval"):
            Sampler([], interval=bad, start=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Probe"):
        Sampler([object()], start=False)  # type: ignore[list-item]


def test_window_statistics_and_broken_probe(caplog: pytest.LogCaptureFixture) -> None:
    probe = ScriptedProbe([{"util": 10, "mem": 0.5}, {"util": 30, "mem": 0.9}, {"util": 20, "mem": 0.1}])
    broken = Broken()
    s = Sampler([probe, broken], interval=1.0, start=False)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            s.sample_now()
    assert len([r for r in caplog.records if "broken" in r.getMessage()]) == 1
    stats = s.summary()
    assert stats["util"].mean == pytest.approx(20.0) and stats["util"].count == 3
    assert stats["mem"].max == 0.9 and stats["mem"].min == 0.1 and stats["mem"].last == 0.1
    s.reset_window()
    assert s.summary() == {}
    assert s.latest() == {"util": 20.0, "mem": 0.1}
    s.close()


class Gated(ThreadRecorder):
    """A read that waits, mid-read, until the test lets it finish (a slow NVML call at an epoch boundary)."""

    name = "gated"

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value
        self.entered = threading.Event()
        self.go = threading.Event()

    def read(self) -> dict[str, float]:
        self.entered.set()
        assert self.go.wait(10)
        return {"mem": self.value}


def test_a_read_begun_before_a_window_reset_stays_out_of_the_new_window() -> None:
    """The last epoch's peak, read just before the next epoch's reset, must not count as the next epoch's."""
    probe = Gated(0.95)
    s = Sampler([probe], interval=1.0, start=False)
    reader = threading.Thread(target=s.sample_now)
    reader.start()
    assert probe.entered.wait(10)
    s.reset_window()  # the next epoch begins while the read is under way
    probe.go.set()
    reader.join(10)
    assert s.summary() == {}
    assert s.latest() == {"mem": 0.95}  # still the latest reading
    probe.value = 0.7
    s.sample_now()  # read after the reset: it counts
    assert s.summary()["mem"].max == 0.7 and s.summary()["mem"].count == 1
    s.close()
