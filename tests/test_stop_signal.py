"""``StopSignal`` under a burst of signals: the process stops, never deadlocks.

A handler that set a ``threading.Event`` itself could deadlock when a second
SIGTERM arrived while the first was being handled (a worker process was
found hung that way after its launcher was killed). Each trial starts a real
process waiting on a ``StopSignal``, sends it a burst of SIGTERMs, and
expects it to exit within seconds: with the status it chose, or killed by a
late SIGTERM of the burst once it was already exiting (the interpreter
restores the default handlers while it shuts down).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

CHILD = """
import sys
from jaxserve.procutil import StopSignal
stop = StopSignal()
print("ready", flush=True)
while not stop.wait(0.05):
    pass
sys.exit(40 + stop.signum)
"""


def test_a_burst_of_sigterms_stops_the_process():
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(50):
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) in (40 + signal.SIGTERM, -signal.SIGTERM)
