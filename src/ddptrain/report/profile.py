"""--profile STEPS: a torch.profiler trace of training steps on rank 0, as a chrome trace.

One warm-up step first (the profiler's own start-up and the first step's allocations would
dominate otherwise), then STEPS steps recorded, then the trace is written to OUT_DIR/profile.json
(open it in chrome://tracing or https://ui.perfetto.dev) and profiling stops: the rest of the
run goes at full speed.
"""

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

FILE = "profile.json"


class StepProfiler:
    def __init__(self, steps: int, out_dir: Path, device: torch.device):
        self.path = out_dir / FILE
        self.written = False
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._write,
        )
        self._profiler.start()
        self._running = True

    def step(self) -> None:
        """After each training step."""
        if self._running:
            self._profiler.step()
            if self.written:
                self.close()

    def close(self) -> None:
        if self._running:
            self._running = False
            self._profiler.stop()

    def _write(self, finished) -> None:
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}.tmp")  # readers never see half a trace
        finished.export_chrome_trace(str(tmp))
        os.replace(tmp, self.path)
        self.written = True
