"""A run's secrets are masked in every log handler, traceback included, and in every failure made
while the run is under way; nothing is masked once it ended."""

from __future__ import annotations

import io
import logging

from tasks.context import StepFailed
from vllm_redeploy.masking import mask_logs
from vllm_redeploy.nodes import RemoteError

TOKEN = "hf_MaskingCheck0123456789"


def test_a_runs_secrets_are_masked_in_logs_and_failures_while_it_runs() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("masking-test")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        stop = mask_logs([TOKEN, "ab"])  # "ab": too short to be masked without harm
        try:
            logger.warning("tail: HF_TOKEN=%s and ab", TOKEN)
            try:
                raise ValueError(f"the engine printed {TOKEN}")
            except ValueError:
                logger.exception("failed")
            assert StepFailed("wait-ready", f"log: {TOKEN}").reason == "log: *****"
            assert str(RemoteError("node-1", f"said {TOKEN}")) == "said *****"
        finally:
            stop()
        logger.warning("after: %s", TOKEN)
    finally:
        logger.removeHandler(handler)
    written = stream.getvalue()
    assert "tail: HF_TOKEN=***** and ab" in written
    assert "ValueError: the engine printed *****" in written  # the traceback too
    assert written.count(TOKEN) == 1 and f"after: {TOKEN}" in written
    assert StepFailed("wait-ready", TOKEN).reason == TOKEN  # no run under way: as it is
