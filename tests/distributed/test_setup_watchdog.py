"""A start-up step whose peers never join ends the rank with a message naming it and the step."""

from __future__ import annotations

import subprocess
import sys

from shardserve.distributed.setup_watchdog import EXIT_CODE

STUCK = """
import time
from shardserve.distributed.setup_watchdog import setup_step
with setup_step("choose and check the all-reduce", rank=1, seconds=1.0):
    time.sleep(60)  # a collective whose peers never come
"""

QUICK = """
from shardserve.distributed.setup_watchdog import setup_step
with setup_step("compare kernel plans", rank=0, seconds=30.0):
    pass
print("done")
"""


def test_a_step_that_never_finishes_stops_the_rank_naming_it():
    done = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=50)
    assert done.returncode == EXIT_CODE
    assert "rank 1: start-up step 'choose and check the all-reduce' did not finish within 1 s" in done.stderr
    assert "SHARDSERVE_SETUP_TIMEOUT_S" in done.stderr


def test_a_step_that_finishes_leaves_the_process_alone():
    done = subprocess.run([sys.executable, "-c", QUICK], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


def test_a_bad_timeout_setting_names_the_variable(set_env):
    import pytest

    from shardserve.distributed.setup_watchdog import TIMEOUT_ENV, timeout_s

    set_env({TIMEOUT_ENV: "soon"})
    with pytest.raises(ValueError, match="SHARDSERVE_SETUP_TIMEOUT_S='soon': expected a positive number of seconds"):
        timeout_s()
