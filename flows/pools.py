"""`sluiceway pools up POOLS.yaml`: local inference pools for development, each N embedded engines behind a
real sglang-router with a pool agent pulling weight versions from a weight store (infra/pool_agent.py).

    seaweedfs: {data_dir: runs/pools/seaweedfs}   # optional: a local S3 server; its AWS_* reach the agents
    pools:
      - {name: east, region: us-east-1, model: tiny-llama, num_engines: 2, weights_uri: s3://sluiceway/demo/weights}
      - {name: west, region: us-west-2, model: tiny-llama, num_engines: 2, weights_uri: s3://sluiceway/demo/weights}

A bare list of pools is accepted too. Every pool gets its own directory under the work directory (logs, the
agent's materialized weights and status.json).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluiceway.flows.config import format_validation_error
from sluiceway.infra.errors import UserError
from sluiceway.infra.pool import EnginePool
from sluiceway.infra.pool_agent import PoolAgent
from sluiceway.infra.router import SGLangRouter
from sluiceway.infra.s3_server import SeaweedS3
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights import WeightStore


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the YAML is a mistake, not a default


class PoolSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    region: str = "local"
    model: str = Field(description="zoo name or HF model directory: what the engines start with")
    num_engines: int = Field(1, ge=1)
    weights_uri: str = Field(description="the weight store the agent polls: a local path or s3://bucket/prefix")
    poll_interval_s: float = Field(2.0, gt=0)
    engine_args: list[str] = []  # extra `sluiceway engine` flags, e.g. ["--dtype", "bfloat16"]


class SeaweedSpec(_Spec):
    data_dir: str | None = None  # default: WORK_DIR/seaweedfs
    bucket: str = "sluiceway"
    access_key: str | None = None
    secret_key: str | None = None


class PoolsFile(_Spec):
    seaweedfs: SeaweedSpec | None = None
    pools: list[PoolSpec] = Field(min_length=1)


def load_pools(path: str | Path) -> PoolsFile:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: {exc}") from None
    if isinstance(raw, list):
        raw = {"pools": raw}
    try:
        spec = PoolsFile.model_validate(raw)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, str(path))) from None
    names = [p.name for p in spec.pools]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: pool names must be unique ({', '.join(names)})")
    return spec


@dataclass
class LocalPool:
    spec: PoolSpec
    router: SGLangRouter
    engines: EnginePool
    agent: PoolAgent

    @property
    def url(self) -> str:
        return self.router.url


@contextlib.contextmanager
def local_pool(
    spec: PoolSpec, work_dir: Path, *, poll: bool = True, env: dict[str, str] | None = None, wait: bool = True
):
    """One pool: router, engines, agent (polling in a thread when ``poll``); all stopped on exit.

    ``wait=False`` returns once the engines are launched: the caller waits (``engines.wait_ready()``) and starts
    the agent, so that several pools load their models side by side.
    """
    from sluiceway.models.zoo import resolve_checkpoint

    pool_dir = work_dir / spec.name
    logs = pool_dir / "logs"
    model = str(resolve_checkpoint(spec.model))  # once here: engines building a zoo model side by side would race
    wstore = WeightStore(ObjectStore.from_uri(spec.weights_uri))
    with contextlib.ExitStack() as stack:
        router = stack.enter_context(SGLangRouter(logs, health_check_interval_s=2))
        engines = EnginePool(model, spec.num_engines, logs, router=router, env=env, engine_args=tuple(spec.engine_args))
        stack.callback(engines.close)
        engines.spawn()
        agent = PoolAgent(spec.name, wstore, lambda: engines.urls, pool_dir / "agent", region=spec.region,
                          poll_interval_s=spec.poll_interval_s)  # fmt: skip
        stack.callback(agent.stop)
        if wait:
            engines.wait_ready()
            if poll:
                agent.start()
        yield LocalPool(spec, router, engines, agent)


@contextlib.contextmanager
def local_pools(spec: PoolsFile, work_dir: Path, *, poll: bool = True) -> Iterator[list[LocalPool]]:
    """Every pool of ``spec`` (and the SeaweedFS server it asks for)."""
    work_dir = Path(work_dir).resolve()
    with contextlib.ExitStack() as stack:
        if spec.seaweedfs is not None:
            s = spec.seaweedfs
            server = SeaweedS3(s.data_dir or work_dir / "seaweedfs", s.bucket, s.access_key, s.secret_key)
            stack.enter_context(server)
            os.environ.update(server.env())  # the agents (threads here) find the store the usual way: AWS_*
        # Launched from this thread (engines die with the thread that started them: PR_SET_PDEATHSIG, so a worker
        # thread per pool would take its engines down when it ends), then waited for together.
        pools = [stack.enter_context(local_pool(p, work_dir, poll=poll, wait=False)) for p in spec.pools]
        for p in pools:
            p.engines.wait_ready()
        if poll:
            for p in pools:
                p.agent.start()
        yield pools


def pools_up(path: str | Path, work_dir: str | Path) -> int:
    """Start the pools of a YAML file, print their routers, and serve until Ctrl-C."""
    spec = load_pools(path)
    work_dir = Path(work_dir)
    # SIGTERM, and SIGINT even where a shell started us with it ignored, unwind the pools like Ctrl-C: the S3
    # server does not die with this process on its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with local_pools(spec, work_dir) as pools:
        if spec.seaweedfs is not None:
            env_file = work_dir.resolve() / "s3.env"
            env_file.write_text("".join(f"export {k}={v}\n" for k, v in _s3_env().items()))
            env_file.chmod(0o600)  # it holds the secret key: never printed
            print(f"seaweedfs: {os.environ['AWS_ENDPOINT_URL']} (credentials: source {env_file})", flush=True)
        for p in pools:
            print(f"pool {p.spec.name} ({p.spec.region}): {p.url}  engines {' '.join(p.engines.urls)}  "
                  f"status {p.agent.status_path}", flush=True)  # fmt: skip
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping pools", flush=True)
    return 0


def _s3_env() -> dict[str, str]:
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP")
    return {k: os.environ[k] for k in keys if k in os.environ}
