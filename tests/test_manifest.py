"""The run manifest (rlver_lib.pipeline.manifest): peak memory."""

import subprocess
import sys

from rlver_lib.pipeline.manifest import track_peak_memory


def test_peak_memory_includes_child_processes():
    code = "b = bytearray(300 * 2**20); import time; time.sleep(1.5)"
    with track_peak_memory(interval_s=0.05) as baseline:
        pass
    with track_peak_memory(interval_s=0.05) as peak:
        subprocess.run([sys.executable, "-c", code], check=True)
    assert peak["peak_rss_mb"] - baseline["peak_rss_mb"] > 250
