"""A real ``pagedllm serve`` process on a free loopback port, serving a tiny random Llama.

One server is shared by the whole session (``server``); tests that need their own flags
start another with ``started_server`` (or ``RemoteServer`` to stop it themselves).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.tokenizer_utils import make_tiny_tokenizer
from tests.utils import make_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 384
MAX_MODEL_LEN = 1024
MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PAGEDLLM_DEVICE": "cpu"})
    env.pop("PAGEDLLM_API_KEY", None)
    env.update(extra or {})
    return env


def serve_command(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model_dir),
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", "512", "--disable-uvicorn-access-log", *extra,
    ]


class RemoteServer:
    """A server subprocess; its combined output goes to ``log_path``."""

    def __init__(self, model_dir: Path | None, log_path: Path, *extra_args: str,
                 env: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """``model_dir`` None: ``pagedllm serve`` as ``make serve`` runs it (the bundled
        demo model, its own name and limits), on this server's port. ``tls``: the server
        speaks HTTPS (its flags among ``extra_args``), reached with this client context."""
        self.port = free_port()
        self.tls = tls
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = serve_command(model_dir, self.port, *extra_args) if model_dir is not None else [
            sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT,
            stdout=self._log, stderr=subprocess.STDOUT, env=server_env(env),
        )
        self._wait_until_healthy()

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"The server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0,
                             verify=self.tls or True).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"The server did not become healthy:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples as ``{'name{labels}': value}`` (labels sorted as exposed)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10.0).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """One pagedllm sample, matched by name and the given labels (model_name implied)."""
        labels = {"model_name": MODEL_NAME, **labels}
        for key, value in self.metrics().items():
            match = re.fullmatch(r"([^{]+)\{(.*)\}", key)
            if not match or match.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            if all(found.get(k) == v for k, v in labels.items()):
                return value
        raise KeyError(f"No sample {name} {labels} in /metrics")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("server-model")
    path = make_tiny_checkpoint(root, "llama", vocab_size=VOCAB_SIZE,
                                max_position_embeddings=MAX_MODEL_LEN)
    make_tiny_tokenizer(path, vocab_size=VOCAB_SIZE)
    return path


@contextlib.contextmanager
def started_server(model_dir: Path, tmp_path_factory, name: str, *flags: str,
                   tls: ssl.SSLContext | None = None):
    """A ``RemoteServer`` with extra ``flags``, its log in a fresh ``name`` folder; stopped
    on exit."""
    remote = RemoteServer(model_dir, tmp_path_factory.mktemp(name) / "server.log", *flags,
                          tls=tls)
    try:
        yield remote
    finally:
        remote.stop()


def openai_client(remote: RemoteServer):
    """The official client for ``remote`` (a context manager), never retrying."""
    import openai

    return openai.OpenAI(base_url=remote.api_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "server-log") as remote:
        yield remote


@pytest.fixture
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
        yield c


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    """Poll until ``predicate()`` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
