"""The Agents SDK's "Error getting response" (logged at every model call that raised, e.g. a reply cut at
max_tokens) comes once per process, as a warning that says why; the SDK's other records pass as they are."""

from __future__ import annotations

import logging

import pytest

from mas_async.gateway.sdk_logs import SDK_LOGGER, CutReplyErrors, quiet_sdk_errors


@pytest.fixture
def sdk_logger():
    logger = logging.getLogger(SDK_LOGGER)
    before = list(logger.filters)
    yield logger
    logger.filters = before


def test_the_sdks_error_for_each_cut_reply_is_one_warning_and_the_rest_are_counted(sdk_logger, caplog):
    quiet = quiet_sdk_errors()
    assert quiet_sdk_errors() is quiet  # installed once
    with caplog.at_level(logging.DEBUG, logger=SDK_LOGGER):
        for i in range(40):
            try:
                raise RuntimeError(f"incomplete {i}")
            except RuntimeError:
                sdk_logger.exception("Error getting response (request_id: %s)", None)
        sdk_logger.error("Tool call failed")
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(said) == 2, said
    assert said[0][0] == "WARNING" and "reply cut at max_tokens" in said[0][1] and caplog.records[0].exc_info is None
    assert said[1] == ("ERROR", "Tool call failed")
    assert (quiet.seen, quiet.dropped) == (40, 39)


def test_without_the_filter_every_one_is_an_error(sdk_logger, caplog):
    sdk_logger.filters = [f for f in sdk_logger.filters if not isinstance(f, CutReplyErrors)]
    with caplog.at_level(logging.DEBUG, logger=SDK_LOGGER):
        for _ in range(3):
            sdk_logger.error("Error getting response")
    assert [r.levelname for r in caplog.records] == ["ERROR"] * 3
