"""Adaptive admission (AIMD) on traces: OOMs that a flush did not stop cut the limit, quiet time grows it,
and a limit that failed is remembered so that probing it again waits ever longer.

The settings here differ from the defaults on purpose (window, recover_after, max_wait), so that a
rule that ignored them and used the default would fail these traces.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from gpu_watchdog.watchdog.core import ladder
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.ladder_state import FailedLimit, Ladder
from gpu_watchdog.watchdog.core.policy import decide
from gpu_watchdog.watchdog.core.samples import ActionRecord, TorchSample
from gpu_watchdog.watchdog.core.state import AdmissionAnswered, AdmissionRequested, CacheFlushRequested, reduce
from gpu_watchdog.watchdog.edge.config import AdmissionSettings, Settings

S = AdmissionSettings(window=45.0, recover_after=200.0, max_wait=1600.0)


def mem(at: float, ooms: int, limit: int, instance: str = "i1", mode: str = "slots", inflight: int = 0,
        queued: int = 0) -> TorchSample:
    return TorchSample(at=at, reachable=True, device="cuda", total_bytes=80 << 30, reserved_bytes=10 << 30,
                       allocated_bytes=9 << 30, ooms=ooms, admission_limit=limit, admission_mode=mode,
                       instance_id=instance, inflight=inflight, queued=queued)


class Trace:
    """A server and the watchdog's view of it: the limit the server runs with follows our changes."""

    def __init__(self, limit: int, settings: AdmissionSettings = S, mode: str = "slots") -> None:
        self.h = History(started_at=0.0, epoch=0.0, served_at=0.0)
        self.settings, self.mode = settings, mode
        self.limit, self.ooms = limit, 0
        self.changes: list[tuple[float, str, int]] = []
        self.sample(0.0)

    @property
    def lad(self) -> Ladder:
        assert self.h.ladder is not None
        return self.h.ladder

    def sample(self, at: float, new_ooms: int = 0, inflight: int | None = None) -> None:
        """What the server reports; by default a flood that fills the limit."""
        self.ooms += new_ooms
        inflight = self.limit if inflight is None else inflight
        reduce(self.h, mem(at, self.ooms, self.limit, mode=self.mode, inflight=inflight, queued=inflight),
               self.settings)

    def flush(self, at: float) -> None:
        reduce(self.h, CacheFlushRequested(at, "oom"), self.settings)

    def step(self, now: float, inflight: int | None = None) -> ladder.Change | None:
        change = ladder.decide(self.settings, self.h, now)
        if change is not None:
            reduce(self.h, AdmissionRequested(change), self.settings)
            reduce(self.h, AdmissionAnswered(now, change, ok=True), self.settings)
            self.limit = change.limit
            self.changes.append((now, change.action, change.limit))
            self.sample(now + 0.01, inflight=inflight)  # the server confirms
        return change

    def oom(self, at: float) -> ladder.Change | None:
        """An OOM the cache rule answered with a flush, then the ladder's turn."""
        self.flush(at)
        self.sample(at + 0.5, new_ooms=1)
        return self.step(at + 0.6)

    def quiet(self, start: float, seconds: float, every: float = 5.0, until: int | None = None) -> float:
        """Samples without OOMs for `seconds` (or until the limit is `until`), the ladder deciding after
        each; the time at the end."""
        now = start
        while now < start + seconds and self.limit != until:
            now += every
            self.sample(now)
            self.step(now + 0.1)
        return now + 0.1


def test_ooms_despite_a_flush_cut_the_rows_in_half_the_canarys_row_included() -> None:
    t = Trace(16)
    t.sample(1, new_ooms=1)
    assert t.step(1.1) is None  # no flush tried yet: the cache rule flushes first
    t.flush(1.2)
    t.sample(2, new_ooms=1)
    change = t.step(2.1)
    # 16 sequences and the canary's reserved row are 17 rows on the card; half of that is 8 rows,
    # 7 sequences beside the canary.
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 7)
    assert change.detail["ooms"] == 2 and change.detail["from"] == 16 and change.detail["rows"] == 17
    # OOMs from before the change do not count against the new limit.
    assert t.step(3.0) is None
    t.sample(4, new_ooms=2)
    change = t.step(4.1)
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 3)  # 8 rows -> 4
    assert [c[1:] for c in t.changes] == [(ladder.SHRINK, 7), (ladder.SHRINK, 3)]
    # Both limits that failed are remembered, each waiting twice recover_after before a probe.
    assert t.lad.failed == (FailedLimit(16, 400.0, 2.1), FailedLimit(7, 400.0, 4.1))
    assert (t.lad.base, t.lad.probing) == (3, False)


@pytest.mark.parametrize(("factor", "cuts"), [(0.25, [3, 1]), (0.75, [11, 8, 5])])
def test_the_cut_follows_decrease_factor(factor: float, cuts: list[int]) -> None:
    t = Trace(16, replace(S, decrease_factor=factor))
    now = 0.0
    for _ in cuts:
        now += 2
        t.flush(now)
        t.sample(now + 0.5, new_ooms=2)
        t.step(now + 0.6)
    # rows = limit + 1; a cut keeps floor(rows * factor) rows, one of them the canary's.
    assert [c[2] for c in t.changes] == cuts


def test_below_the_threshold_or_outside_the_window_nothing_changes() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=1)
    t.flush(46.5)
    t.sample(47, new_ooms=1)  # the second comes 46 s after the first: outside the 45 s window
    assert t.step(47.5) is None and t.lad.limit == 16
    t.sample(90, new_ooms=1)  # 43 s after the second: inside it
    t.flush(90.2)
    change = t.step(90.5)
    assert change is not None and change.limit == 7


def test_oom_threshold_is_the_number_of_ooms_that_cut() -> None:
    t = Trace(16, replace(S, oom_threshold=3))
    t.flush(0.5)
    t.sample(1, new_ooms=1)
    t.sample(2, new_ooms=1)
    assert t.step(2.1) is None
    t.sample(3, new_ooms=1)
    change = t.step(3.1)
    assert change is not None and change.detail["ooms"] == 3


def test_min_limit_is_the_floor_of_a_cut() -> None:
    t = Trace(16, replace(S, min_limit=4))
    for now in (2.0, 4.0, 6.0):
        t.flush(now)
        t.sample(now + 0.5, new_ooms=2)
        t.step(now + 0.6)
    assert [c[2] for c in t.changes] == [7, 4]


def test_a_flush_that_cures_leaves_the_limit_alone() -> None:
    t = Trace(16)
    t.sample(1, new_ooms=1)
    t.flush(1.1)
    t.quiet(1.1, 300)
    assert t.changes == []


def test_settles_then_grows_one_step_per_quiet_wait_to_the_ceiling() -> None:
    t = Trace(6)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    assert t.limit == 2  # 7 rows -> 3
    # 3, 4 and 5 never failed: one step per recover_after; 6 failed, so the last step waits twice that.
    end = t.quiet(1.1, 1200)
    grows = [(round(at - prev_at), limit) for (prev_at, _, _), (at, _, limit) in itertools.pairwise(t.changes)]
    # (The first sample after a change is its confirmation: the waits start from there.)
    assert grows == [(205, 3), (205, 4), (205, 5), (405, 6)]
    assert t.limit == 6 and t.step(end + 1000) is None  # at the ceiling


def test_a_probe_goes_back_a_step_on_one_oom_and_the_failure_is_remembered() -> None:
    t = Trace(8)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)  # 9 rows -> 4: limit 3
    now = t.quiet(1.1, 300, until=4)
    assert t.limit == 4 and t.lad.probing
    change = t.oom(now + 10)  # one OOM is enough on probation, and it goes back one step, not a cut
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 3)
    assert t.lad.remembered(4) == FailedLimit(4, 400.0, now + 10.6)
    # Probing 4 again waits twice as long: each failure doubles it, up to max_wait.
    waits = []
    now += 10.6
    for _ in range(5):
        start = now
        now = t.quiet(now, 5000, until=4)
        waits.append(round(now - start))
        t.oom(now + 1)
        now += 1.6
    assert waits == [405, 805, 1605, 1605, 1605]


def test_a_probe_that_holds_keeps_the_memory_of_a_failure() -> None:
    """The seed's ladder reset the wait to recover_after after any probe that held a wait: a limit
    that fails only some of the time was then probed again and again at the shortest wait."""
    t = Trace(8)
    t.h.ladder = replace(t.lad, limit=3, base=3, failed=(FailedLimit(4, 800.0, 0.0),), changed_at=0.0)
    t.limit = 3
    now = t.quiet(0.0, 900, until=4)
    assert t.limit == 4  # 4 held the whole 800 s wait earlier, then failed
    now = t.quiet(now, 300, until=5)
    assert t.limit == 5  # 4 held recover_after: 5 never failed, so it is probed after recover_after
    assert t.lad.remembered(4) == FailedLimit(4, 800.0, 0.0)  # holding a probe erased nothing
    t.oom(now + 1)  # 5 fails: back to 4, still on probation
    assert (t.limit, t.lad.base) == (4, 3)
    t.oom(now + 100)  # 4 fails too (when the canary coincides): back to 3, 4's wait doubles from 800
    assert t.limit == 3 and t.lad.remembered(4) == FailedLimit(4, 1600.0, now + 100.6)
    assert t.lad.remembered(5) == FailedLimit(5, 400.0, now + 1.6)


def test_a_quiet_period_as_long_as_the_longest_wait_forgives() -> None:
    t = Trace(8)
    t.h.ladder = replace(t.lad, limit=4, base=3, failed=(FailedLimit(4, 800.0, 0.0), FailedLimit(5, 1600.0, 0.0)),
                         changed_at=0.0)
    t.limit = 4
    now = t.quiet(0.0, 1500)
    assert (t.limit, t.lad.base) == (4, 3)  # quiet, but not yet for the longest wait (1600 s)
    now = t.quiet(now, 200, until=5)
    # Quiet at 4 for the longest remembered wait: 4 is the new base and its failure is forgiven (then 5
    # is probed); what failed above it is still remembered.
    assert t.lad.base == 4 and t.lad.remembered(4) is None and t.lad.remembered(5) is not None
    t.oom(now + 1)  # 5 fails: back to 4
    assert (t.limit, t.lad.base) == (4, 4)
    # Confirmed, an OOM at 4 is no longer a failed probe: one OOM alone changes nothing.
    assert t.oom(now + 10) is None and t.limit == 4


def test_ooms_of_the_sequences_admitted_under_the_old_limit_do_not_count() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=2, inflight=16)
    t.step(1.1, inflight=16)
    assert t.limit == 7
    # The 16 sequences admitted before the cut still run, and meet OOMs: not 7's.
    t.sample(1.5, new_ooms=2, inflight=12)
    t.sample(2.0, new_ooms=2, inflight=9)
    assert t.step(2.1) is None
    t.sample(2.5, inflight=7)  # in force now
    t.sample(3.0, new_ooms=2, inflight=7)
    change = t.step(3.1)
    assert change is not None and change.limit == 3


def test_an_operators_change_is_the_new_ceiling() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)  # 16 -> 7
    t.limit = 10  # an operator sets 10 through the control API
    t.sample(5)
    assert (t.lad.ceiling, t.lad.limit, t.lad.base, t.lad.failed) == (10, 10, 10, ())
    t.sample(400)
    assert t.step(401) is None  # already at the (new) ceiling


def test_bytes_mode_grows_by_an_eighth_of_the_ceiling() -> None:
    t = Trace(40, mode="bytes")
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    assert t.limit == 19  # 41 worst-case sequences' rows -> 20
    now = t.quiet(1.1, 300, until=24)
    assert t.limit == 24
    t.oom(now + 1)  # the probe fails: back one step of 5
    assert t.limit == 19


def test_a_new_process_starts_from_its_own_limit() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    reduce(t.h, mem(10, 0, 16, instance="i2"), S)
    assert (t.lad.instance_id, t.lad.limit, t.lad.ceiling, t.lad.failed) == ("i2", 16, 16, ())


def test_disabled_and_at_the_floor() -> None:
    off = Trace(16, replace(S, enabled=False))
    off.flush(0.5)
    off.sample(1, new_ooms=5)
    assert off.step(1.1) is None
    floor = Trace(1)
    floor.flush(0.5)
    floor.sample(1, new_ooms=5)
    assert floor.step(1.1) is None


class Card:
    """A flood that always fills the admitted limit on a card that holds `rows` rows. The canary
    (every 30 s) takes its reserved row beside them; it coincides with a full batch only now and
    then (`coincide`), so `rows - 1` sequences fail only some of the time and `rows - 2` never."""

    def __init__(self, rows: int, coincide: float, seed: int) -> None:
        self.rows, self.coincide, self.rng = rows, coincide, random.Random(seed)

    def oom(self, limit: int, at: float) -> bool:
        canary = at % 30 < 5 and self.rng.random() < self.coincide
        return limit + (1 if canary else 0) > self.rows


def run(card: Card, hours: float, settings: AdmissionSettings = S) -> tuple[Trace, list[float], list[int]]:
    """The watchdog on the card, sampled every 5 s: (trace, when OOMs came, the limit at each sample)."""
    t = Trace(16, settings)
    ooms: list[float] = []
    limits: list[int] = []
    now = 0.0
    while now < hours * 3600:
        now += 5
        if card.oom(t.limit, now):
            ooms.append(now)
            t.flush(now - 1)  # the cache rule's answer to the OOM, before the ladder's turn
            t.sample(now, new_ooms=1)
        else:
            t.sample(now)
        t.step(now + 0.1)
        limits.append(t.limit)
    return t, ooms, limits


@pytest.mark.parametrize("seed", range(5))
def test_a_limit_that_fails_only_when_the_canary_coincides_is_probed_ever_further_apart(seed: int) -> None:
    card = Card(rows=4, coincide=0.2, seed=seed)
    t, ooms, limits = run(card, hours=12)
    # Cut twice (16 -> 7 -> 3), then never below 3: an intermittent failure is a failed probe, not a cut.
    assert [c[2] for c in t.changes[:2]] == [7, 3]
    assert min(limits[60:]) == 3 and max(limits[60:]) <= 5
    # 4 fails when the canary coincides, however long it held before: each failure doubles the wait
    # before the next probe, up to max_wait; holding a probe for a while does not reset it.
    probes = [at for at, action, limit in t.changes if action == ladder.GROW and limit == 4]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert all(g >= 400 for g in gaps[1:]), gaps
    assert sum(g >= 1600 for g in gaps) >= len(gaps) - 3, gaps
    # So a card that stays too small costs about one OOM per max_wait, not one per recover_after.
    late = [at for at in ooms if at > 6 * 3600]
    assert len(late) <= 6 * 3600 / 1600 + 1, late


def test_a_limit_that_holds_but_for_the_canary_settles_with_its_probes_spaced() -> None:
    """The same card with a canary that always coincides (a flood at every canary): 3 holds, 4 never."""
    t, ooms, limits = run(Card(rows=4, coincide=1.0, seed=0), hours=6)
    assert min(limits[60:]) == 3 and max(limits[60:]) == 4
    assert t.lad.remembered(4) == FailedLimit(4, 1600.0, t.lad.remembered(4).at)  # type: ignore[union-attr]
    assert len([at for at in ooms if at > 3 * 3600]) <= 3 * 3600 / 1600 + 1


def test_the_policy_shrinks_beside_the_flush_and_never_restarts_for_it() -> None:
    s = Settings().policy
    h = History(started_at=0.0, epoch=0.0, served_at=0.0)
    for at, ooms in ((0, 0), (5, 1), (10, 3)):
        reduce(h, mem(at, ooms, 16), s.admission)
    h.actions.append(ActionRecord(6, "empty_cache", "oom"))
    ds = decide(s, h, 10.5)
    assert [(d.action, d.reason, d.detail["limit"]) for d in ds] == [("shrink_admission", "oom", 7)]
    assert not any(d.action == "restart" for d in ds)


def test_only_time_with_the_limit_in_full_use_counts_as_quiet() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    assert t.limit == 7
    # The server's own OOM recovery holds its batch at 3 (or the load is light): however long, that
    # says nothing about 7, and the limit does not grow.
    for at in range(5, 1000, 5):
        t.sample(at, inflight=3)
        assert t.step(at + 0.1) is None
    # In full use again: one step after recover_after.
    now = t.quiet(1000, 400, until=8)
    assert t.limit == 8 and 1190 <= now <= 1210


def test_an_oom_between_a_grow_and_its_first_sample_is_the_probes() -> None:
    t = Trace(8)
    t.h.ladder = replace(t.lad, limit=3, base=3, changed_at=0.0)
    t.limit = 3
    t.quiet(0.0, 195)
    t.sample(200.5)
    grow = ladder.decide(t.settings, t.h, 201.0)
    assert grow is not None and (grow.action, grow.limit) == (ladder.GROW, 4)
    reduce(t.h, AdmissionRequested(grow), t.settings)
    reduce(t.h, AdmissionAnswered(201.0, grow, ok=True), t.settings)
    t.limit = 4
    # The first sample at 4 already shows an OOM (a canary coincided). After a cut such a rise,
    # straddling the change, may be the old limit's; after a grow it is the probe's: 3 had held.
    t.sample(202.0, new_ooms=1)
    change = ladder.decide(t.settings, t.h, 202.1)
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 3)
