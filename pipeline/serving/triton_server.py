"""A local Triton server for a model repository, from the `tritonserver` binary that `nvidia-pytriton` bundles.

That binary has the Python backend only (no ONNX Runtime, OpenVINO or TensorRT backend), so it runs the
Python-backend models of an exported repository; the graph and ensemble models need Triton's own container.
`nvidia-pytriton` pins numpy<2, so it lives in its own environment (`make` makes `.venv-triton`, with the
pipeline runtime installed), which is also the Python environment the models run in.

    with LocalTriton(repository, python_env=".venv-triton") as server:
        server.url   # http://127.0.0.1:<port>
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from pipeline.errors import ServingError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> None:
    """A ServingError naming `port` when something on this host already listens on it."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise ServingError(f"port {port} on 127.0.0.1 is in use; pass another port or stop what holds it") from None


def _environment_paths(python_env: Path) -> tuple[Path, Path, str]:
    """(pytriton's tritonserver folder, the folder of the interpreter's libpython, its X.Y version) of a Python
    environment."""
    python = python_env / "bin" / "python"
    if not python.exists():
        raise ServingError(f"no Python environment at {python_env}; make one with `make triton-env` (or pass it)")
    script = (
        "import os, sys, sysconfig, pytriton; print(os.path.dirname(pytriton.__file__)); "
        "print(sysconfig.get_config_var('LIBDIR')); print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    )
    found = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    if found.returncode:
        raise ServingError(f"{python_env} has no nvidia-pytriton; pip install 'pipeline[triton]' into it")
    package, libdir, version = found.stdout.split()
    return Path(package) / "tritonserver", Path(libdir), version


def _backend_dir(home: Path, scratch: Path, version: str) -> Path:
    """A backends folder whose python backend has the stub for this Python version beside it, as Triton wants."""
    python = scratch / "backends" / "python"
    python.mkdir(parents=True)
    for item in (home / "backends" / "python").iterdir():
        (python / item.name).symlink_to(item)
    stub = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServingError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    shutil.copy(stub, python / stub.name)
    return scratch / "backends"


class LocalTriton:
    """A tritonserver on 127.0.0.1 serving `repository`, started on enter and stopped by its pid on exit."""

    def __init__(self, repository, python_env, http_port: int | None = None, ready_timeout_s: float = 120.0):
        self.repository = Path(repository).resolve()
        self.python_env = Path(python_env).resolve()
        if http_port is not None:
            check_port_free(http_port)
        self.http_port = http_port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.prefix = f"pipeline{uuid.uuid4().hex[:12]}"
        self._scratch = Path(tempfile.mkdtemp(prefix="triton-"))
        self.log = self._scratch / "tritonserver.log"

    def _command(self, home: Path, version: str) -> list[str]:
        python_options = [
            f"shm-region-prefix-name={self.prefix}",
            "shm-default-byte-size=4194304",
            "shm-growth-byte-size=1048576",
        ]
        return [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={_backend_dir(home, self._scratch, version)}",
            f"--cache-directory={home / 'caches'}",
            *(f"--backend-config=python,{option}" for option in python_options),
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={free_port()}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={free_port()}",
            "--allow-gpu-metrics=false",
            "--strict-readiness=true",
            "--exit-timeout-secs=5",
        ]

    def __enter__(self) -> LocalTriton:
        home, libdir, version = _environment_paths(self.python_env)
        env = {**os.environ, "PATH": f"{self.python_env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        # The stub must load this interpreter's libpython, not another of the same version.
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(home.parent.parent / "nvidia_pytriton.libs"), str(libdir)])
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                self._command(home, version),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServingError(f"tritonserver exited with {self.process.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return
            time.sleep(0.2)
        raise ServingError(f"tritonserver was not ready within {self.ready_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 4) -> str:
        """The server log's error lines (else its last lines), joined into one."""
        with contextlib.suppress(OSError):
            text = self.log.read_text(errors="replace").strip().splitlines()
            errors = [line for line in text if line.startswith("E") or "error" in line.lower()]
            return " | ".join((errors or text)[-lines:])
        return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server by its pid (SIGKILL its process group past `timeout_s`) and remove its shared memory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for segment in glob.glob(f"/dev/shm/{self.prefix}*"):
            with contextlib.suppress(OSError):
                os.unlink(segment)
        shutil.rmtree(self._scratch, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.stop()
