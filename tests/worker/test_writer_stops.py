"""The result writer's thread ends when told to, even after its process was stopped and
continued with a signal pending for that thread (what a supervisor's SIGTERM right after
SIGCONT can do): a `queue.SimpleQueue.get` with a timeout that a signal interrupts past its
deadline waits forever in CPython, and the worker then never exited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# In its own process: a writer (no ledger: it never has a row to commit), SIGTERM handled as a
# worker handles it and blocked in the main thread, so that the kernel hands it to the writer's
CHILD = """
import signal, sys, threading
from conveyor.worker.writer import ResultWriter
signal.signal(signal.SIGTERM, lambda *_: None)
writer = ResultWriter(None, heartbeat_timeout=1.0)
writer.start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("ready", flush=True)
sys.stdin.readline()
writer.stop()
writer.join(timeout=5)
print("stuck" if writer.is_alive() else "stopped", flush=True)
"""


def test_the_writer_stops_after_its_process_was_stopped_and_signalled() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # the writer waits in its queue
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.5)  # past the wait's deadline
        os.kill(child.pid, signal.SIGTERM)  # pending: delivered to the writer's thread
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.3)
        child.stdin.write("stop\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "stopped"
    finally:
        child.kill()
        child.wait(10)
