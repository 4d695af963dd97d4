"""Under torchrun, a rank tells torchrun's OMP_NUM_THREADS=1 default from the user's."""

import os
import subprocess
import sys
from pathlib import Path

from cli import DEADLINE

PROBE = """
import os
from ddptrain.dist.threads import _launcher_env, user_set_threads
print("user" if user_set_threads(os.environ, _launcher_env()) else "default")
"""


def _torchrun(probe: Path, env: dict) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(
        [*torchrun, str(probe)],
        env={**env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=True,
    )
    return sorted(out.stdout.split())


def test_torchrun_default_and_user_setting(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _torchrun(probe, unset) == ["default", "default"]
    assert _torchrun(probe, {**unset, "OMP_NUM_THREADS": "1"}) == ["user", "user"]
