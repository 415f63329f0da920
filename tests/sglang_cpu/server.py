"""Start and stop the RELEASED SGLang server (`python -m sglang.launch_server`) on this machine's CPU.

The server is real: sglang 0.5.23 from the venv tests/sglang_cpu/install.py made (outside the
checkout). Only the kernel library `sgl_kernel` is a stand-in (tests/sglang_cpu/sgl_kernel, first
on PYTHONPATH; its docstring says why). The command line is the one roles/sglang_server builds for
0.5.23 (--tp-size 1 --dp-size 1 --pp-size 1 --disable-radix-cache --cuda-graph-backend-prefill
disabled), plus what the CPU needs (../shared/DESIGN.md section 12): `--device cpu` with
SGLANG_USE_CPU_ENGINE=1 (without it sglang imports vllm), `--max-total-tokens 8192` (by default the
KV pool reserves ~70% of RAM), `--sleep-on-idle`.

    with CPUServer(model_dir, dump_dir=..., dump_layers="1,2,3") as srv:   # waits for /health
        srv.url, srv.start_seconds
    python tests/sglang_cpu/server.py --model-path DIR [--starts 3]        # time starts (JSON)

The server runs in a process group of its own; stop() sends SIGTERM to launch_server (it ends its
scheduler and detokenizer), then SIGKILL to the whole group after `stop_timeout` seconds, and
kills whatever of the group is still alive after launch_server is gone. launch_server also gets
SIGTERM when the process that started it dies (PR_SET_PDEATHSIG): a killed test run leaves none.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from install import STAMP, default_venv  # noqa: E402  (this directory's installer)

STANDIN_DIR = Path(__file__).resolve().parent  # holds sgl_kernel/
INSTALL_CMD = "python tests/sglang_cpu/install.py (or: make sglang-cpu)"
ROLE_ARGS = ("--tp-size", "1", "--dp-size", "1", "--pp-size", "1", "--cuda-graph-backend-prefill", "disabled")
# --sleep-on-idle: an idle scheduler otherwise polls its sockets without pause (a whole core).
CPU_ARGS = ("--device", "cpu", "--max-total-tokens", "8192", "--sleep-on-idle")


class ServerError(RuntimeError):
    """The server could not be started (the message holds the tail of its log)."""


def venv_problem(venv: Path | None = None) -> str | None:
    """Why the SGLang CPU venv cannot be used, naming the install command; None when it can."""
    venv = venv or default_venv()
    if not (venv / STAMP).is_file() or not (venv / "bin" / "python").exists():
        return (
            f"no finished SGLang CPU venv at {venv} (no {STAMP}): run {INSTALL_CMD}; "
            "HSX_SGLANG_CPU_VENV names another place"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CPUServer:
    """One launch_server process (group) on 127.0.0.1; a context manager (start / stop)."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        log_path: str | os.PathLike,
        dump_dir: str | None = None,
        dump_layers: str | None = None,
        radix_cache: bool = False,
        chunked_prefill_size: int | None = None,
        api_key: str | None = None,
        extra_args: tuple[str, ...] = (),
        venv: Path | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 30.0,
    ):
        self.venv = Path(venv or default_venv())
        problem = venv_problem(self.venv)
        if problem:
            raise ServerError(problem)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.api_key = api_key
        self.argv = [
            str(self.venv / "bin" / "python"),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *CPU_ARGS,
            *ROLE_ARGS,
        ]
        if not radix_cache:
            self.argv.append("--disable-radix-cache")
        if chunked_prefill_size:
            self.argv += ["--chunked-prefill-size", str(chunked_prefill_size)]
        if api_key:
            self.argv += ["--api-key", api_key]
        self.argv += list(extra_args)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HSX_", "PYTHON"))}
        env.update(
            SGLANG_USE_CPU_ENGINE="1",
            HF_HUB_OFFLINE="1",
            PYTHONPATH=str(STANDIN_DIR),
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.pop("OMP_NUM_THREADS", None)  # sglang sets the CPU engine's threads itself
        if dump_dir:
            env["HSX_DUMP_DIR"] = dump_dir
        if dump_layers:
            env["HSX_DUMP_LAYERS"] = dump_layers
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None

    def __enter__(self) -> CPUServer:
        """Starts it unless start() already did; __exit__ stops it."""
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def start(self) -> float:
        """Start it and wait for GET /health 200; the seconds it took (ServerError with its log)."""
        if self.proc is not None:
            raise ServerError(f"already started (pid {self.proc.pid}); stop() it first")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_term_with_parent,
            )
        while self._health() != 200:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"launch_server exited with {self.proc.returncode} before it was "
                    f"healthy; its log {self.log_path} ends:\n{self.log_tail()}"
                )
            if time.monotonic() - t0 > self.start_timeout:
                self.stop()
                raise ServerError(
                    f"not healthy after {self.start_timeout:.0f} s; its log ends:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.start_seconds = time.monotonic() - t0
        return self.start_seconds

    def stop(self) -> float | None:
        """SIGTERM to launch_server, SIGKILL to its group after stop_timeout; the seconds it took."""
        if self.proc is None:
            return None
        t0 = time.monotonic()
        pgid = self.proc.pid  # start_new_session: the group's id is launch_server's pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(pgid, self.stop_timeout)
        self.proc.wait()
        self.proc = None
        self.stop_seconds = time.monotonic() - t0
        return self.stop_seconds


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a killed test
    run must not leave a server behind; Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _kill_group(pgid: int, wait: float) -> None:
    """Let what is left of the group end for `wait` seconds (the scheduler drains), then SIGKILL it."""
    deadline = time.monotonic() + wait
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Time starts of the real SGLang server on the CPU.")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--starts", type=int, default=1)
    ap.add_argument("--log", default="/tmp/hsx-sglang-cpu-server.log")
    args = ap.parse_args(argv)
    figures = []
    for _ in range(args.starts):
        srv = CPUServer(args.model_path, log_path=args.log)
        with srv:
            pass
        figures.append({"start_s": round(srv.start_seconds, 1), "stop_s": round(srv.stop_seconds, 1)})
        print(json.dumps(figures[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
