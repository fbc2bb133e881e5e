"""StopHold: a stop waits for the block to end, unless the block hangs or the stop comes twice."""

import os
import signal
import time

import pytest

from gguf_assets.lib.training.stops import StopHold, is_stop


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_stop_is_delivered_when_the_block_ends():
    hold, done = StopHold(max_hold_s=30), []
    with pytest.raises(KeyboardInterrupt):
        with hold:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            done.append("the rest of the step")
    assert done and not hold.forced
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers put back


def test_a_block_that_hangs_gets_the_stop_after_the_hold():
    hold = StopHold(max_hold_s=0.3)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with hold:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(20)  # a hung step
    assert hold.forced and time.monotonic() - start < 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind


def test_a_second_stop_is_delivered_at_once():
    hold = StopHold(max_hold_s=30)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with hold:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(20)
    assert hold.forced and time.monotonic() - start < 5


def test_dagsters_interrupt_is_a_stop_by_its_name():
    class DagsterExecutionInterruptedError(BaseException):
        pass

    class Wrapped(DagsterExecutionInterruptedError):
        pass

    assert is_stop(KeyboardInterrupt()) and is_stop(Wrapped()) and not is_stop(RuntimeError("failed"))
