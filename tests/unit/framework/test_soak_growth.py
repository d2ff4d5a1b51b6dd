"""The soak's growth figures (bench/soak.py): a process's own warm-up (a cache filling to its bound) is not growth,
a figure says what it rests on, and a role whose processes all died young gets no figure rather than 0.0."""

from __future__ import annotations

import pytest

from bench.soak import Series, growth, report

MB = 1e6
MIN = 60.0


def _warming(role: str, name: str, pid: int, born_s: float, died_s: float, step_s: float = 10.0) -> Series:
    """An env worker as the soak sampled them: 333 MB at birth, +3 MB a minute for 10 minutes (its tokenizers'
    caches filling), then flat."""
    s = Series(role, name, pid)
    t = born_s
    while t <= died_s:
        age_min = (t - born_s) / MIN
        s.samples.append((t, int((333 + 3 * min(age_min, 10.0)) * MB), 20, 5))
        t += step_s
    return s


def test_a_warm_up_that_flattens_is_not_growth() -> None:
    # Born at 0 and at 40 min, each living 20 minutes: the old fit (from max(10 min, birth + 2 min)) read the
    # second one's warm-up as +75 MB/h.
    series = [
        _warming("env_worker", "env_worker/0", 1, 0, 20 * MIN),
        _warming("env_worker", "env_worker/0", 2, 40 * MIN, 60 * MIN),
    ]
    g = growth(series, warmup_s=10 * MIN, own_warmup_s=10 * MIN, min_span_s=5 * MIN, age_s=2 * MIN)["env_worker"]
    assert g["processes"] == 2 and g["processes_seen"] == 2
    assert g["process_minutes"] == pytest.approx(20, abs=0.5)
    assert g["rss_mb_per_h_worst"] == pytest.approx(0, abs=1e-6)
    assert g["rss_at_age_processes"] == 2 and g["rss_at_age_mb_per_h"] is None  # (two points: no slope)


def test_a_role_killed_young_has_no_figure_and_says_so() -> None:
    # Replacements born every 4 minutes, each killed 3 minutes later: none lives past its own warm-up.
    series = [
        _warming("env_worker", "env_worker/0", pid, 4 * MIN * pid, 4 * MIN * pid + 3 * MIN) for pid in range(1, 14)
    ]
    figures = growth(series, warmup_s=10 * MIN, own_warmup_s=10 * MIN, min_span_s=5 * MIN, age_s=2 * MIN)
    g = figures["env_worker"]
    assert g["processes"] == 0 and g["process_minutes"] == 0 and g["processes_seen"] == 13
    assert g["rss_mb_per_h_worst"] is None and g["rss_pct_per_h_median"] is None and g["fds_range"] is None
    # What it still says: every replacement is as big at 2 minutes old as the first one was.
    assert g["rss_at_age_processes"] == 13 and g["rss_at_age_mb_per_h"] == pytest.approx(0, abs=1e-6)
    assert g["rss_at_age_range_mb"] == pytest.approx([339, 339])
    result = {
        "config": "c.yaml", "overrides": [], "minutes": 60, "kill_every_s": 60, "kills": [], "warmup_min": 10,
        "own_warmup_min": 10, "min_span_s": 300, "growth": figures, "dir_bytes_per_iteration": {},
        "checks": {"iterations": 0, "every_iteration_once": True, "version_mismatch_zero": True,
                   "no_episode_uncounted": True, "restarts": {}, "finished_by_itself": True, "exit_status": 0,
                   "finish_s": 1.0},
    }  # fmt: skip
    line = next(line for line in report(result) if line.startswith("env_worker"))
    growth_part, at_age_part = line.split(" | ")
    assert "no figure: none of its 13 processes" in growth_part and "0.00" not in growth_part, line
    assert "13 procs, +0.00 MB/h, 339-339 MB" in at_age_part, line


def test_a_leak_past_the_warm_up_is_still_seen() -> None:
    s = _warming("router", "router", 1, 0, 60 * MIN)
    s.samples = [(t, rss + int(t / 3600 * 30 * MB), fds, th) for t, rss, fds, th in s.samples]  # +30 MB/h
    g = growth([s], warmup_s=10 * MIN, own_warmup_s=10 * MIN, min_span_s=5 * MIN, age_s=2 * MIN)["router"]
    assert g["processes"] == 1 and g["process_minutes"] == pytest.approx(50, abs=0.5)
    assert g["rss_mb_per_h_worst"] == pytest.approx(30, rel=0.01)


def test_a_process_caught_mid_exit_is_not_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    # A killed process releases its memory and files before it becomes a zombie: read in that window it shows
    # 0 fds and 0 RSS, which is not a sample of it (a fresh-clone CI run failed on an env worker's "0 fds").
    import os
    import types

    import bench.soak as soak

    real = soak.psutil.Process

    class Exiting:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def oneshot(self):  # noqa: ANN202
            return real(os.getpid()).oneshot()

        def memory_info(self):  # noqa: ANN202
            return types.SimpleNamespace(rss=0)

        def num_fds(self) -> int:
            return 0

        def num_threads(self) -> int:
            return 1

    run = types.SimpleNamespace(proc=types.SimpleNamespace(pid=os.getpid()), pids=lambda: {"env_worker/0": 424242})
    monkeypatch.setattr(soak.psutil, "Process", lambda pid: real(pid) if pid == os.getpid() else Exiting(pid))
    series: dict[tuple[str, int], Series] = {}
    soak.sample(run, series, 1.0)
    assert list(series) == [("launcher", os.getpid())]
    assert series[("launcher", os.getpid())].samples[0][2] > 0


def test_the_growth_is_split_by_memory_part() -> None:
    # A trainer whose thread arenas grow 12 MB/h while its heap is flat: the split says where the growth lies.
    s = _warming("trainer", "trainer/p", 1, 0, 60 * MIN)
    s.parts = [(t, {"heap": 200 * 2**20, "arenas": int((20 + 12 * t / 3600) * MB), "anon": 90 * 2**20, "file": 0})
               for t, *_ in s.samples]  # fmt: skip
    plain = _warming("router", "router", 2, 0, 60 * MIN)  # a role the soak does not split
    figures = growth([s, plain], warmup_s=10 * MIN, own_warmup_s=10 * MIN, min_span_s=5 * MIN, age_s=2 * MIN)
    parts = figures["trainer"]["rss_parts_mb_per_h"]
    assert parts["arenas"]["median"] == pytest.approx(12, rel=0.01)
    assert parts["heap"]["worst"] == pytest.approx(0, abs=1e-6)
    assert parts["anon"]["median"] == pytest.approx(0, abs=1e-6)
    assert "rss_parts_mb_per_h" not in figures["router"]
