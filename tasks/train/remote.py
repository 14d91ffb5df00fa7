"""The driver's handle on a torchrun trainer process group (tasks/train/worker.py): same methods as PolicyTrainer.

The flow process starts the group once per run and drives it step after step; the model is never rebuilt. The
control channel is a loopback socket authenticated with a random key passed through the environment; rank 0
listens on a port the OS picks (so two runs cannot collide) and writes it to a file the driver reads. Every socket
of the group is on loopback (tasks/train/torchrun.py, infra/proc.py `loopback_collectives`).
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from sluiceway.infra.proc import LOOPBACK, child_env, die_with_parent
from sluiceway.tasks.train.worker import recv, send


class TrainerGroupError(RuntimeError):
    """The trainer process group failed; the message carries the remote error or the tail of its log."""


def first_rank_error(error_dir: Path) -> str:
    """'rank N: <its error line>' of the rank that failed first (tasks/train/worker.py `record_failure`), or ''."""
    records = []
    for path in error_dir.glob("rank*.error"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    records = [r for r in records if isinstance(r, dict) and {"rank", "time", "error"} <= r.keys()]
    if not records:
        return ""
    first = min(records, key=lambda r: (r["time"], r["rank"]))
    others = sorted(r["rank"] for r in records if r is not first)
    also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too)" if others else ""
    return f"rank {first['rank']}: {first['error']}{also}"


class TrainerGroup:
    """PolicyTrainer's interface for a trainer that runs elsewhere: every method is `_call(name, ...)`, which a
    subclass implements (a socket to a torchrun group's rank 0, or calls on Ray rank actors)."""

    weight_version: int

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def train_rollout(self, samples: list, step: int) -> dict[str, float]:
        metrics = self._call("train_rollout", samples, step)
        self._refresh()
        return metrics

    def train_sft(self, samples: list, step: int) -> dict[str, float]:
        metrics = self._call("train_sft", samples, step)
        self._refresh()
        return metrics

    def gradients(self, samples: list, step: int):
        return self._call("gradients", samples, step)

    def save(self, path: str | Path, step: int) -> None:
        self._call("save", str(path), step)

    def load(self, path: str | Path) -> int:
        step = self._call("load", str(path))
        self._refresh()
        return step

    def write_weights(
        self, hf_dir: str | Path, root: str | Path, dtype: str | None = None, adapter_only: bool = False
    ) -> Path:
        return Path(self._call("write_weights", str(hf_dir), str(root), dtype, adapter_only))

    def state(self) -> dict[str, int]:
        """Rank 0's PolicyTrainer.state()."""
        return self._call("state")

    def _refresh(self) -> None:
        self.weight_version = self.state()["weight_version"]


class RemoteTrainer(TrainerGroup):
    def __init__(
        self,
        init_kwargs: dict[str, Any],
        nproc: int,
        work_dir: str | Path,
        threads_per_proc: int = 1,
        start_timeout_s: float = 600.0,
    ):
        """Start `nproc` ranks with torchrun; `init_kwargs` are PolicyTrainer's arguments (configs as dicts)."""
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        init_file = self.work_dir / "trainer_init.json"
        init_file.write_text(json.dumps(init_kwargs, default=str))
        self.log_path = self.work_dir / "trainer.log"
        key = secrets.token_bytes(32)
        control_file = self.work_dir / "trainer_control"
        control_file.unlink(missing_ok=True)  # a previous group's address
        self.error_dir = self.work_dir / "trainer_errors"
        shutil.rmtree(self.error_dir, ignore_errors=True)  # a previous group's failures
        self.error_dir.mkdir()
        env = child_env(  # no credentials: the driver does every store call (infra/proc.py)
            SLUICEWAY_TRAINER_INIT=str(init_file),
            SLUICEWAY_TRAINER_CONTROL=f"{LOOPBACK}:0",
            SLUICEWAY_TRAINER_CONTROL_FILE=str(control_file),
            SLUICEWAY_TRAINER_AUTHKEY=key.hex(),
            SLUICEWAY_TRAINER_THREADS=str(threads_per_proc),
            SLUICEWAY_TRAINER_ERROR_DIR=str(self.error_dir),
            OMP_NUM_THREADS=str(threads_per_proc),
        )
        cmd = [
            sys.executable,
            "-m",
            "sluiceway.tasks.train.torchrun",
            "--rdzv-backend=loopback",
            "--rdzv-endpoint=127.0.0.1:0",  # the store picks its port; torchrun warns without an endpoint
            f"--nproc-per-node={nproc}",
            "-m",
            "sluiceway.tasks.train.worker",
        ]
        self._log = open(self.log_path, "ab")
        # torchrun stops its ranks on SIGTERM, which the kernel sends if the flow process dies (infra/proc.py).
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        self.conn = None
        try:
            self.conn = self._connect(control_file, key, start_timeout_s)
            self.world_size = self._reply()["world_size"]
        except BaseException:
            self.close()
            raise
        self.weight_version = 0

    def _connect(self, control_file: Path, key: bytes, timeout_s: float):
        # Rank 0 listens, and writes where, only once its model is built.
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise TrainerGroupError(
                    f"trainer group exited with {self.proc.returncode} at start{self._cause()}{self._log_tail()}"
                )
            try:
                host, port = control_file.read_text().rsplit(":", 1)
                return Client((host, int(port)), authkey=key)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    msg = f"trainer group did not start within {timeout_s:.0f}s{self._cause()}{self._log_tail()}"
                    raise TrainerGroupError(msg) from None
                time.sleep(0.2)

    def _cause(self) -> str:
        # The failing rank's own line, not torchrun's summary of exit codes (which ends the log).
        first = first_rank_error(self.error_dir)
        return f": {first}" if first else ""

    def _log_tail(self, lines: int = 30) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"; last lines of {self.log_path}:\n" + "\n".join(tail)

    def _reply(self) -> Any:
        try:
            status, value = recv(self.conn)
        except (EOFError, ConnectionError, OSError):
            self.proc.wait(timeout=60)
            died = f"trainer group died (exit {self.proc.returncode}){self._cause()}"
            raise TrainerGroupError(f"{died}{self._log_tail()}") from None
        if status == "error":
            first = first_rank_error(self.error_dir)  # rank 0's error may only be that another rank went first
            cause = f"\n(first failure: {first})" if first and not first.startswith("rank 0:") else ""
            raise TrainerGroupError(f"trainer rank 0: {value}{cause}")
        return value

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        send(self.conn, ("call", method, args, kwargs))
        return self._reply()

    def close(self) -> None:
        """Stop the group: politely over the control channel, then by signal if it does not exit."""
        conn = self.conn
        if conn is not None:
            try:
                send(conn, ("stop",))
                conn.close()
            except OSError:
                pass
            self.conn = None
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()
