"""The OpenAI Agents SDK's error log of a call that raised, said once per process instead of at every call.

The SDK logs an ERROR "Error getting response" (logger `openai.agents`) for every model call that raised,
before it raises on; on the Responses API a reply cut at `max_tokens` (`status: "incomplete"`) is such a
call, so a run whose replies reach the limit logs dozens of them per env worker, each a traceback, though
the program handles the exception (docs/gateway.md, "The OpenAI Agents SDK"). `quiet_sdk_errors` turns the
first into a WARNING that says why it comes and where it is counted, and drops the rest (counted in
`CutReplyErrors.dropped`); every other record of the SDK is left as it is.
"""

from __future__ import annotations

import logging

SDK_LOGGER = "openai.agents"
MESSAGE = "Error getting response"


class CutReplyErrors(logging.Filter):
    """Lets the SDK's first "Error getting response" through as a WARNING with its explanation, drops the others."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(MESSAGE):
            return True
        self.seen += 1
        if self.seen > 1:
            self.dropped += 1
            return False
        record.msg = (
            f"{record.getMessage()}: the OpenAI Agents SDK logs this for every model call that raised, e.g. a reply "
            "cut at max_tokens (the Responses API's status 'incomplete', raised as ModelBehaviorError); the program "
            "sees the exception, and the sample is trained as sampled. Logged once per process (docs/gateway.md)"
        )
        record.args = ()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def quiet_sdk_errors() -> CutReplyErrors:
    """Install `CutReplyErrors` on the SDK's logger once per process; returns the one installed."""
    logger = logging.getLogger(SDK_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, CutReplyErrors):
            return existing
    installed = CutReplyErrors()
    logger.addFilter(installed)
    return installed
