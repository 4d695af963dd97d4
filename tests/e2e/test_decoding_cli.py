"""A run trains with torchvision.io's DeprecationWarning made an error: no decoding, in the
training process or its loader workers, goes through the deprecated torchvision.io. Without
CUDA, --decode-device cuda is refused in one line."""

from cli import ddptrain, env_with, ok, tiny_args
from test_user_errors import assert_user_error


def test_a_run_trains_with_deprecation_warnings_as_errors(tiny_data, tmp_path):
    env = env_with(PYTHONWARNINGS="error::DeprecationWarning")
    args = tiny_args(tiny_data, tmp_path / "run", "-j", "1")
    result = ok(ddptrain("train", *args, env=env))
    assert "DeprecationWarning" not in result.stderr


def test_decoding_on_the_gpu_is_refused_without_cuda(tiny_data, tmp_path):
    args = tiny_args(tiny_data, tmp_path / "run", "--decode-device", "cuda", "--device", "cpu")
    result = ddptrain("train", *args, env=env_with())
    assert_user_error(result, "--decode-device cuda", "runs on cpu")
    assert result.returncode == 2 and not (tmp_path / "run" / "checkpoint.pt").exists()
