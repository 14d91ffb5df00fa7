"""`sluiceway pools up POOLS.yaml`: local inference pools for development, each N embedded engines behind a
real sglang-router with a pool agent pulling weight versions from a weight store (infra/pool_agent.py).

    seaweedfs: {data_dir: runs/pools/seaweedfs}   # optional: a local S3 server; its AWS_* reach the agents
    pools:
      - {name: east, region: us-east-1, model: tiny-llama, num_engines: 2, weights_uri: s3://sluiceway/demo/weights}
      - {name: west, region: us-west-2, model: tiny-llama, num_engines: 2, weights_uri: s3://sluiceway/demo/weights}

A bare list of pools is accepted too. Every pool gets its own directory under the work directory (logs, the
agent's materialized weights and status.json).

Each pool registers in the pool registry beside its weight store (storage/weights/pool_registry.py), so a run
with `--rollout-pools auto` finds it: ``url`` is the router address runs should use (default: the router's own,
on loopback; a pool elsewhere names its load balancer or ingress, and binds ``host``). Leaving: SIGTERM (or a
first Ctrl-C) drains every pool of the process, `sluiceway pools drain NAME` one pool; a drained pool deregisters
and stops its engines, and the process ends when no pool is left. A second signal stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sluiceway.flows.config import format_validation_error
from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.errors import UserError
from sluiceway.infra.pool_agent import PoolAgent
from sluiceway.infra.router import SGLangRouter
from sluiceway.infra.s3_server import SeaweedS3
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.pool_registry import MAX_HEARTBEAT_S, PoolRegistry, name_problem, url_problem
from sluiceway.storage.weights.store import WeightStore


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the YAML is a mistake, not a default


class PoolSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")  # and not "local" (the validator below), as runs read it
    region: str = Field("local", max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")  # as runs check a record's
    model: str = Field(description="zoo name or HF model directory: what the engines start with")
    num_engines: int = Field(1, ge=1)
    weights_uri: str = Field(description="the weight store the agent polls: a local path or s3://bucket/prefix")
    poll_interval_s: float = Field(2.0, gt=0)
    engine_args: list[str] = []  # extra `sluiceway engine` flags, e.g. ["--dtype", "bfloat16"]
    host: str = "127.0.0.1"  # where the router listens; 0.0.0.0 for a pool that runs elsewhere than its runs
    router_port: int | None = Field(None, ge=1, le=65535)  # default: a free port
    url: str | None = Field(None, pattern=r"^https?://[^/\s]+", description="the router as runs reach it")
    capacity: int | None = Field(None, ge=1, description="samples in flight at once (default: the run's limit)")
    heartbeat_s: float = Field(10.0, gt=0, le=MAX_HEARTBEAT_S)
    drain_timeout_s: float = Field(600.0, gt=0)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if (problem := name_problem(value)) is not None:  # what a run would refuse of its record
            raise ValueError(problem)
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and (problem := url_problem(value)) is not None:  # as runs check its record
            raise ValueError(problem)
        return value


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
    engines: EngineGroup
    agent: PoolAgent
    close: Callable[[], None]  # stops the agent, the engines and the router (once drained, or at exit)

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
        router = SGLangRouter(logs, health_check_interval_s=2, host=spec.host, port=spec.router_port)
        stack.enter_context(router)
        engines = EngineGroup(model, spec.num_engines, logs, router=router, env=env,
                              engine_args=tuple(spec.engine_args))  # fmt: skip
        stack.callback(engines.close)
        engines.spawn()
        agent = PoolAgent(spec.name, wstore, lambda: engines.urls, pool_dir / "agent", region=spec.region,
                          poll_interval_s=spec.poll_interval_s, url=spec.url or router.url, capacity=spec.capacity,
                          heartbeat_s=spec.heartbeat_s, drain_timeout_s=spec.drain_timeout_s)  # fmt: skip
        stack.callback(agent.stop)
        if wait:
            engines.wait_ready()
            if poll:
                agent.start()
        yield LocalPool(spec, router, engines, agent, stack.close)


@contextlib.contextmanager
def local_pools(spec: PoolsFile, work_dir: Path, *, poll: bool = True,
                before_agents: Callable[[], None] | None = None) -> Iterator[list[LocalPool]]:  # fmt: skip
    """Every pool of ``spec`` (and the SeaweedFS server it asks for). `before_agents` runs once the engines are
    ready, just before the agents register the pools (where a stop must become a drain)."""
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
        if before_agents is not None:
            before_agents()
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
    early: list[int] = []  # a signal between the pools' registration and the drain handler: drained just below

    def hold_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: early.append(signum))

    with local_pools(spec, work_dir, before_agents=hold_signals) as pools:
        leaving = _Leaving(pools)
        signal.signal(signal.SIGINT, leaving.on_signal)
        signal.signal(signal.SIGTERM, leaving.on_signal)
        if early:
            leaving.on_signal(early[0], None)
        if spec.seaweedfs is not None:
            env_file = work_dir.resolve() / "s3.env"
            env_file.write_text("".join(f"export {k}={v}\n" for k, v in _s3_env().items()))
            env_file.chmod(0o600)  # it holds the secret key: never printed
            print(f"seaweedfs: {os.environ['AWS_ENDPOINT_URL']} (credentials: source {env_file})", flush=True)
        for p in pools:
            print(f"pool {p.spec.name} ({p.spec.region}): {p.url}  engines {' '.join(p.engines.urls)}  "
                  f"status {p.agent.status_path}", flush=True)  # fmt: skip
        try:
            leaving.serve()
        except KeyboardInterrupt:
            print("stopping pools", flush=True)
    return 0


class _Leaving:
    """The pools of one `pools up` until each has left: the first signal drains them all, a second stops at once."""

    def __init__(self, pools: list[LocalPool]) -> None:
        self.live = list(pools)
        self.signalled = False

    def on_signal(self, signum, frame) -> None:
        if self.signalled:
            raise KeyboardInterrupt
        self.signalled = True
        print(f"draining pools {', '.join(p.spec.name for p in self.live)} (again to stop at once)", flush=True)
        for p in self.live:
            p.agent.drain()

    def serve(self) -> None:
        """Until every pool has drained: a drained pool's engines and router stop as soon as it has left."""
        while self.live:
            for p in [p for p in self.live if p.agent.left.is_set()]:
                self.live.remove(p)
                p.close()
                print(f"pool {p.spec.name} left", flush=True)
            time.sleep(0.2)


def drain_pool(name: str, weights_uri: str) -> int:
    """`sluiceway pools drain NAME --weights-uri URI`: ask a registered pool to leave."""
    registry = PoolRegistry(WeightStore(ObjectStore.from_uri(weights_uri)))
    if name not in registry.records():
        raise UserError(f"pools drain: no pool named {name!r} is registered in {weights_uri}")
    registry.request_drain(name)
    print(f"pool {name}: asked to drain; it deregisters once its engines are idle", flush=True)
    return 0


def list_pools(weights_uri: str) -> int:
    """`sluiceway pools list --weights-uri URI`: the registered pools (no URLs: they may hold credentials)."""
    records = PoolRegistry(WeightStore(ObjectStore.from_uri(weights_uri))).records()
    if not records:
        print(f"no pool is registered in {weights_uri}")
        return 0
    print(f"{'pool':16} {'region':14} {'state':9} {'serving':>7} {'capacity':>8}  last heartbeat")
    for name, r in records.items():
        beat = _timestamp(r.updated_unix)
        serving = "-" if r.serving is None else f"v{r.serving}"
        print(f"{name:16} {r.region:14} {r.state:9} {serving:>7} {r.capacity or '-':>8}  {beat}")
    return 0


def _timestamp(unix: float | None) -> str:
    """A record's last write as UTC ISO time: "-" when it has none, "unknown" when no date can show it (a
    record's clock may be anything: a year past 9999 is a finite number)."""
    import datetime as dt

    if unix is None:
        return "-"
    try:
        return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat()[:19]
    except (ValueError, OverflowError, OSError):
        return "unknown"


def _s3_env() -> dict[str, str]:
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP")
    return {k: os.environ[k] for k in keys if k in os.environ}
