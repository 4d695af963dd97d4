"""Under torchrun, a rank tells torchrun's OMP_NUM_THREADS=1 default from the user's."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from cli import DEADLINE

# Each rank writes its answer to its own file: the ranks share torchrun's stdout, where two
# unbuffered prints can interleave ("defaultdefault\n\n").
PROBE = """
import os, sys
from pathlib import Path
from ddptrain.distributed.threads import _launcher_env, user_set_threads
answer = "user" if user_set_threads(os.environ, _launcher_env()) else "default"
Path(sys.argv[1], "rank" + os.environ["RANK"]).write_text(answer)
"""


def _torchrun(probe: Path, env: dict) -> list[str]:
    answers = probe.parent / "answers"
    shutil.rmtree(answers, ignore_errors=True)
    answers.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    subprocess.run(
        [*torchrun, str(probe), str(answers)],
        env={**env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=True,
    )
    return [(answers / f"rank{rank}").read_text() for rank in (0, 1)]


def test_torchrun_default_and_user_setting(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _torchrun(probe, unset) == ["default", "default"]
    assert _torchrun(probe, {**unset, "OMP_NUM_THREADS": "1"}) == ["user", "user"]
