import io
import os
import subprocess
import sys

import pytest

from ddptrain.errors import UserError, one_line, report, report_errors, write_line
from ddptrain.report.progress import make_progress, say


def test_user_errors_become_one_line_and_exit_2(capsys):
    def fail():
        raise UserError("--arch: unknown architecture 'x'")

    assert report_errors(fail) == 2
    assert capsys.readouterr().err == "ddptrain: error: --arch: unknown architecture 'x'\n"


def test_an_error_reported_early_is_not_printed_again(capsys):
    # run.train reports before its teardown; the CLI's report_errors sees the same error after.
    error = UserError("the loss became non-finite at global step 2")

    def fail():
        assert report(error) == 2
        raise error

    assert report_errors(fail) == 2
    assert capsys.readouterr().err.count("ddptrain: error:") == 1


def test_the_line_goes_out_in_one_write(monkeypatch):
    # Every failed rank writes its line into the launcher's one pipe: a line written in two
    # parts (text, then newline) ran into another rank's line.
    writes = []

    class Pipe:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Pipe())
    assert report(UserError("the loss became non-finite at global step 2")) == 2
    assert writes == ["ddptrain: error: the loss became non-finite at global step 2\n"]


def test_loader_worker_errors_lose_the_worker_traceback():
    # What DataLoader re-raises in the main process for a UserError raised in a worker.
    rebuilt = UserError(
        "Caught UserError in DataLoader worker process 1.\n"
        "Original Traceback (most recent call last):\n"
        '  File "worker.py", line 3, in fetch\n'
        "ddptrain.errors.UserError: cannot read image /d/a.png: truncated\n"
    )
    assert one_line(rebuilt) == "cannot read image /d/a.png: truncated"


def test_bugs_keep_their_traceback():
    def bug():
        raise KeyError("internal")

    with pytest.raises(KeyError):
        report_errors(bug)


def test_success_is_exit_0():
    assert report_errors(lambda: None) == 0


@pytest.mark.parametrize(
    "message",
    [
        "Application timeout caused pair closure",
        "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5000",
        "Timed out waiting 10000ms for recv operation to complete",
    ],
)
def test_a_lost_peer_is_one_line_and_exit_1(capsys, message):
    def collective():
        raise RuntimeError(message)

    assert report_errors(collective) == 1
    assert capsys.readouterr().err.startswith("ddptrain: error: lost contact with another rank")


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_every_line_a_rank_shows_is_one_write(monkeypatch):
    # Every rank writes into the same pipes: under PYTHONUNBUFFERED, print's separate write of
    # the newline let another rank's error line land in the middle of rank 0's list of bad
    # images ("...PIL readsddptrain: error: ..."). Each line is one write.
    stream = Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    say("bad image a.png: truncated", stderr=True)
    write_line("ddptrain: error: one line")
    make_progress("lines", stream).write("epoch 1/1 [1/1] loss 1.0")
    assert stream.writes == [
        "bad image a.png: truncated\n",
        "ddptrain: error: one line\n",
        "epoch 1/1 [1/1] loss 1.0\n",
    ]


def test_a_path_that_is_not_utf8_is_printed_escaped(monkeypatch):
    """A folder named in Latin-1, printed to a stdout strict about UTF-8 (a UTF-8 locale's),
    ended the run in a UnicodeEncodeError traceback."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", out)
    latin1 = os.fsdecode(b"/tmp/caf\xe9")
    assert report_errors(lambda: print(f"out dir: {latin1}")) == 0
    out.flush()
    assert out.buffer.getvalue() == b"out dir: /tmp/caf\\udce9\n"


def test_a_process_ended_by_end_process_keeps_its_code_output_and_exit_handlers():
    """end_process skips the interpreter's last collections, nothing else: the exit code, the
    unflushed output and the atexit handlers all come through."""
    script = (
        "import atexit, sys\n"
        "from ddptrain.errors import end_process\n"
        "atexit.register(lambda: sys.stderr.write('handler ran'))\n"
        "sys.stdout.write('x' * 100_000)\n"
        "end_process(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, len(done.stdout), done.stderr) == (3, 100_000, "handler ran")
