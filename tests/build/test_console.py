"""Progress bars go to stderr on a terminal only, and --quiet hides them."""

import fcntl
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
import warnings

import pytest

from pipeline.build.console import silenced
from tests.conftest import REPO


def _build_args(tiny_bert, texts_file, calibration_file, tmp_path, *flags):
    return [
        sys.executable,
        "-m",
        "pipeline",
        *flags,
        "build",
        "--model",
        str(tiny_bert),
        "--target",
        "cpu-avx2",
        "--validation",
        str(texts_file),
        "--calibration",
        str(calibration_file),
        "--artifacts-dir",
        str(tmp_path / "a"),
        "--cache-dir",
        str(tmp_path / "c"),
    ]


def _on_a_terminal(args) -> str:
    """Run `args` with stderr on a pseudo-terminal; returns what it wrote there."""
    leader, follower = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and tqdm draws nothing in 0 columns: give it a real size.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=follower, cwd=REPO)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert child.wait(timeout=600) == 0
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow  # three builds under a pseudo-terminal
def test_progress_shows_on_a_terminal_and_not_when_piped_or_quiet(tiny_bert, texts_file, calibration_file, tmp_path):
    shown = _on_a_terminal(_build_args(tiny_bert, texts_file, calibration_file, tmp_path / "tty"))
    assert "search: building candidates" in shown
    piped = subprocess.run(
        _build_args(tiny_bert, texts_file, calibration_file, tmp_path / "pipe"),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert piped.returncode == 0 and "search:" not in piped.stderr and "\r" not in piped.stderr
    quiet = _on_a_terminal(_build_args(tiny_bert, texts_file, calibration_file, tmp_path / "quiet", "--quiet"))
    assert "search:" not in quiet


def test_silenced_hides_warnings_and_info_then_restores_levels(caplog):
    logger = logging.getLogger("some.library")
    logger.setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO, logger="some.library"):
        warnings.simplefilter("always")
        with silenced("some.library"):
            logger.warning("advice nobody asked for")
            warnings.warn("noise", UserWarning, stacklevel=1)
            logger.error("a real error")
        logger.info("after")
    assert [r.getMessage() for r in caplog.records] == ["a real error", "after"]
    assert seen == []
    assert logger.level == logging.INFO
