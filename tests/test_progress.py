"""One progress display per phase (issue 38, item 5): start and end lines, progress lines with rate and ETA at
ProgressLines' cadence in logs, a bar on a terminal with the lines going to train.log only, and the warm start,
build and training phases of a real CLI run in its train.log."""

from __future__ import annotations

import pytest

from async_rl.progress import Phase


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_counted_phase_in_a_log_prints_start_progress_and_end(capsys):
    clock, logged = Clock(), []
    with Phase("warm start", detail="SFT on toy_keys", terminal=False, every_steps=10, clock=clock,
               log_only=logged.append) as phase:
        for step in range(1, 26):  # 2 s a step: lines at 1, then every 10 steps or 10 s, and the last
            clock.now += 2.0
            phase.update(step, f"loss {1 / step:.3f}", total=25)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "warm start: SFT on toy_keys"
    assert out[-1] == "warm start: done in 50.0 s"
    progress = out[1:-1]
    assert [line.split()[2] for line in progress] == ["1/25", "6/25", "10/25", "15/25", "20/25", "25/25"]
    # the count was learnt at step 1 (2 s in, after the phase's setup): the rate is timed from there, and that first
    # line has none; step 10: 9 steps in 18 s, 2 s a step, 15 steps left
    assert progress[0] == "warm start: 1/25 steps loss 1.000 | elapsed 0 s"
    assert progress[2] == "warm start: 10/25 steps loss 0.100 | 2.0 s/step, elapsed 18 s, eta 30 s"
    assert logged == []  # no bar: the printed lines are what train.log gets


def test_by_default_a_fast_phase_prints_a_line_every_tenth_of_its_count(capsys):
    clock = Clock()
    with Phase("warm start", terminal=False, clock=clock, log_only=lambda line: None) as phase:
        for step in range(1, 451):  # 450 SFT steps at 14 a second: 32 s in all
            clock.now += 1 / 14
            phase.update(step, total=450)
    counts = [int(line.split()[2].split("/")[0]) for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert counts == [1] + list(range(45, 451, 45))


def test_on_a_terminal_the_bar_shows_and_the_lines_go_to_the_log_only(capsys):
    clock, logged = Clock(), []
    with Phase("eval", total=4, unit="sample", terminal=True, clock=clock, log_only=logged.append) as phase:
        for done in range(1, 5):
            clock.now += 1.0
            phase.update(done)
        assert phase.bar.n == 4
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["eval: started", "eval: done in 4.0 s"]
    assert logged[0] == "eval: 1/4 samples | 1.0 s/sample, elapsed 1 s, eta 3 s" and logged[-1].startswith("eval: 4/4")


def test_a_phase_without_a_count_has_a_start_and_an_end_line_and_says_how_it_ended(capsys):
    clock = Clock()
    with Phase("build", detail="actor in this process", clock=clock, log_only=lambda line: None) as phase:
        clock.now = 1.25
        phase.update(3)  # nothing to count: no line
    with pytest.raises(ValueError), Phase("build", clock=clock, log_only=lambda line: None):
        clock.now = 2.5
        raise ValueError("no model")
    with pytest.raises(KeyboardInterrupt), Phase("training", total=3, terminal=False, clock=clock,
                                                 log_only=lambda line: None):
        raise KeyboardInterrupt
    assert capsys.readouterr().out.splitlines() == [
        "build: actor in this process", "build: done in 1.2 s",
        "build: started", "build: failed after 1.2 s (ValueError)",
        "training: started", "training: stopped after 0.0 s"]


def test_a_resumed_phase_counts_its_rate_from_where_it_resumed(capsys):
    clock = Clock()
    with Phase("training", total=50, terminal=False, clock=clock, log_only=lambda line: None) as phase:
        phase.start_at(40)
        clock.now = 20.0
        phase.update(41)
        clock.now = 40.0
        phase.update(42)
    lines = capsys.readouterr().out.splitlines()
    # 2 steps run by this process in 40 s: 20 s a step, not 40 s / 42
    assert lines[-2] == "training: 42/50 steps | 20.0 s/step, elapsed 40 s, eta 160 s"


def test_a_count_that_moves_in_batches_gives_the_right_rate(capsys):
    clock = Clock()
    with Phase("[eval] toy_keys", total=128, unit="sample", terminal=False, clock=clock,
               log_only=lambda line: None) as phase:
        clock.now = 1.0
        phase.update(64)  # the first batch of 64 samples, 1 s in: 64 a second, not 1 s a sample
    assert capsys.readouterr().out.splitlines()[1] == \
        "[eval] toy_keys: 64/128 samples | 64 samples/s, elapsed 1 s, eta 1 s"


def test_a_phase_stopped_on_purpose_says_stopped_and_a_resume_before_the_count_is_kept(capsys):
    class Stopped(Exception):  # the driver's RunStopped is an Exception: a signal stops the run at a cut
        pass

    clock = Clock()
    with pytest.raises(Stopped), Phase("training", total=3, terminal=False, clock=clock, log_only=lambda line: None,
                                       stopped_by=(Stopped,)):
        clock.now = 1.0
        raise Stopped
    assert capsys.readouterr().out.splitlines()[-1] == "training: stopped after 1.0 s"
    with Phase("warm start", terminal=False, every_steps=1, clock=clock, log_only=lambda line: None) as phase:
        phase.start_at(10)  # resumed at 10, before the count is known
        clock.now = 3.0
        phase.update(11, total=20)
        clock.now = 5.0
        phase.update(12)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "warm start: 11/20 steps | elapsed 0 s"  # step 11 starts the timing
    assert lines[2] == "warm start: 12/20 steps | 2.0 s/step, elapsed 2 s, eta 16 s"
