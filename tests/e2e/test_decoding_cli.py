"""A run trains with torchvision.io's DeprecationWarning made an error: no decoding, in the
training process or its loader workers, goes through the deprecated torchvision.io."""

from cli import ddptrain, env_with, ok, tiny_args


def test_a_run_trains_with_deprecation_warnings_as_errors(tiny_data, tmp_path):
    env = env_with(PYTHONWARNINGS="error::DeprecationWarning")
    args = tiny_args(tiny_data, tmp_path / "run", "-j", "1")
    result = ok(ddptrain("train", *args, env=env))
    assert "DeprecationWarning" not in result.stderr
