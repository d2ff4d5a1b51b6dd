"""SIGUSR1 to the launcher becomes RUN_DIR/stop_request.json, which the router reads before each step: a
signal that comes before the run directory is known is kept until it is, and a request an earlier run
left behind is cleared when a run starts (else the resumed run would stop again at once)."""

from __future__ import annotations

import os
import signal

from mas_async.launch.stop_signal import StopOnSignal
from mas_async.router.stop_request import STOP_REQUEST, request_stop, stop_requested


def test_a_signal_before_the_run_is_known_is_written_when_it_is(tmp_path):
    stop = StopOnSignal()
    previous = stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # handled before kill returns (signal to this thread)
        assert stop.asked and not stop_requested(tmp_path)
        stop.attach(tmp_path)
        assert stop_requested(tmp_path)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_after_attach_asks_the_router_and_a_left_request_is_cleared(tmp_path):
    request_stop(tmp_path, "an earlier run's")
    stop = StopOnSignal()
    previous = stop.install()
    try:
        stop.attach(tmp_path)
        assert not stop_requested(tmp_path) and not stop.asked  # the earlier run's request is gone
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.asked and stop_requested(tmp_path)
        assert '"why": "SIGUSR1"' in (tmp_path / STOP_REQUEST).read_text()
    finally:
        signal.signal(signal.SIGUSR1, previous)
