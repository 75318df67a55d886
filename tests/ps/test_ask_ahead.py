"""When a worker asks the batch queue one index ahead (worker/ask_ahead.py): only where the answers are slow
against the time it trains between them, decided anew each epoch from its first answers."""

from __future__ import annotations

import pytest

from ivyplug.ps.worker.ask_ahead import MIN_WAIT, PROBE_ASKS, WAIT_SHARE, AskAhead


def _epoch(ahead: AskAhead, wait: float, train: float, asks: int = PROBE_ASKS) -> None:
    ahead.start_epoch()
    t = 0.0
    for _ in range(asks):
        ahead.answered(sent=t, received=t + wait)
        t += wait + train


def test_loopback_answers_keep_asking_on_demand_and_slow_ones_ask_ahead() -> None:
    ahead = AskAhead()
    _epoch(ahead, wait=0.0002, train=0.02)  # loopback: 1% of a batch
    assert not ahead.enabled and not ahead.deciding
    _epoch(ahead, wait=0.08, train=0.05)  # behind a push on a slow link
    assert ahead.enabled
    _epoch(ahead, wait=0.001, train=0.05)  # the link is fast again: decided anew
    assert not ahead.enabled


def test_the_threshold_is_the_share_of_the_time_between_asks() -> None:
    ahead = AskAhead()
    _epoch(ahead, wait=WAIT_SHARE * 0.5 * 0.9, train=0.5)  # just below a share of the 0.5 s between answers
    assert not ahead.enabled
    _epoch(ahead, wait=WAIT_SHARE * 0.5 * 1.1, train=0.5)
    assert ahead.enabled


def test_answers_of_a_few_milliseconds_never_ask_ahead() -> None:
    """A busy machine's loopback: an answer of 4 ms against 10 ms batches stays on demand."""
    ahead = AskAhead()
    _epoch(ahead, wait=MIN_WAIT * 0.8, train=0.01)
    assert not ahead.enabled
    _epoch(ahead, wait=MIN_WAIT * 1.5, train=0.01)
    assert ahead.enabled


def test_nothing_is_decided_before_the_probe_answers_and_later_ones_change_nothing() -> None:
    ahead = AskAhead()
    _epoch(ahead, wait=1.0, train=0.01, asks=PROBE_ASKS - 1)
    assert ahead.deciding and not ahead.enabled
    ahead.answered(sent=10.0, received=11.0)
    assert ahead.enabled and not ahead.deciding
    ahead.answered(sent=20.0, received=20.0)  # a fast answer after the decision: kept for this epoch
    assert ahead.enabled


def test_one_slow_answer_among_fast_ones_does_not_decide() -> None:
    ahead = AskAhead()
    ahead.start_epoch()
    for sent, wait in ((0.0, 0.0001), (0.05, 0.3), (0.4, 0.0001)):  # the median answer is fast
        ahead.answered(sent=sent, received=sent + wait)
    assert not ahead.enabled


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"probe_asks": 1}, "probe_asks"), ({"wait_share": -0.1}, "wait_share"), ({"min_wait": -1.0}, "min_wait")],
)
def test_bad_arguments_are_named(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AskAhead(**kwargs)  # type: ignore[arg-type]
