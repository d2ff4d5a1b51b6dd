"""A trainer whose first compute pass of iteration SLOW_ITERATION's streamed step takes SLOW_S seconds longer,
and an env worker that says which episodes it is sent: for a fault test that needs a pass slower than a turn
(the groups of later turns wait for it) and to know which worker runs which episode. Production code has no
hook for this; `tests.support.slow_pass_roles:ROLES` builds these subclasses.

Log lines a test reads:
- trainer: "slow pass over groups [<group key>, ...] (<seconds>s)" as that pass begins, and
  "took groups [<group key>, ...] of episode <id> (attempt <n>)" for each Groups message of the iteration;
- env worker: "running episode <id> (attempt <n>)" as a RunEpisode arrives.
"""

from __future__ import annotations

import logging
import time

from mas_async.rollout.env_worker import EnvWorker
from mas_async.training.streaming import SampleKey, StreamingStep
from mas_async.training.trainer import Trainer
from mas_async.wire.messages import Groups, Message, RunEpisode, samples_from_wire
from mas_async.wire.samples import Sample
from tests.support.slow_pass_roles import SLOW_ITERATION, SLOW_S

log = logging.getLogger("mas_async.tests.slow_pass")


class SlowPassStep(StreamingStep):
    """A streamed step whose first compute pass sleeps SLOW_S seconds first, in the step's compute thread (so
    the groups that come meanwhile wait for it), when the step is iteration SLOW_ITERATION's."""

    slowed = False

    def _compute(self, keyed: list[tuple[SampleKey, Sample]]) -> None:
        if self.version == SLOW_ITERATION and not self.slowed:
            self.slowed = True
            log.warning("slow pass over groups %s (%gs)", sorted({key.group for key, _ in keyed}), SLOW_S)
            time.sleep(SLOW_S)
        super()._compute(keyed)


class SlowPassTrainer(Trainer):
    """The trainer with SlowPassStep for its streamed steps; logs the groups it takes in SLOW_ITERATION."""

    def _stream_of(self, version: int) -> StreamingStep:
        if self.stream is None or self.stream.version != version:
            self.stream = SlowPassStep(self.learner, version)
        return self.stream

    def _take(self, msg: Groups) -> None:
        if msg.iteration == SLOW_ITERATION:
            groups = sorted({s.group for s in samples_from_wire(msg.samples)})
            log.info("took groups %s of episode %s (attempt %d)", groups, msg.episode_id, msg.attempt)
        super()._take(msg)


class LoggingEnvWorker(EnvWorker):
    """An env worker that says which episodes it is sent."""

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, RunEpisode):
            log.info("running episode %s (attempt %d)", msg.episode_id, msg.attempt)
        await super().on_message(msg)
