"""Process liveness (gguf_assets.lib.core.liveness): a live pid, an ended one, a zombie, a reused pid."""

import os
import subprocess
import sys
import time

import psutil

from gguf_assets.lib.core import liveness


def test_this_process_is_alive_and_a_reaped_child_is_not():
    assert liveness.process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not liveness.process_alive(child.pid)


def test_a_zombie_counts_as_gone():
    """Killed but not yet reaped by its parent: the pid still exists, and holds nothing."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # not reaped: no wait() or poll() yet
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert psutil.pid_exists(child.pid) and not liveness.process_alive(child.pid)
    finally:
        child.wait()


def test_a_holder_is_gone_when_its_pid_was_reused_or_it_ran_before_this_boot():
    me, started, boot = os.getpid(), liveness.process_started(os.getpid()), liveness.boot_id()
    assert started and not liveness.holder_is_gone(holder_boot_id=boot, holder_pid=me, holder_started=started)
    assert liveness.holder_is_gone(holder_boot_id=boot, holder_pid=me, holder_started="12.34")  # another process
    if boot:
        assert liveness.holder_is_gone(holder_boot_id="another boot", holder_pid=me, holder_started=started)
