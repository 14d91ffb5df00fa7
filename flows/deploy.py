"""`sluiceway server` and `sluiceway serve`: a real Prefect server with its UI, and deployments of the flows.

    sluiceway server [--port 4200] [--host 127.0.0.1] [--home .sluiceway/prefect]
    sluiceway serve [CONFIG.yaml] [run flags] [--cron EXPR | --interval SECONDS] [--pool NAME] [--api-url URL]

`server` runs `prefect server start` on loopback with its home (SQLite database, settings) inside the project.
`serve` registers one deployment per flow (`sluiceway-rl/NAME`, `sluiceway-sft/NAME`, `sluiceway-eval/NAME`,
`sluiceway-replay/NAME`) whose parameter is the run config (rl's typed as `RunConfig`, so the UI renders a
form); the config given to `serve` (YAML and flags, as for `run`) is its default. Without `--pool` the
`serve` process itself runs the deployments' flow runs (Prefect's `serve`); with `--pool NAME` the
deployments go to a Prefect work pool and `serve` exits: a `prefect worker start --pool NAME` then runs them.
Schedules are Prefect's own (`--cron`, `--interval`); there is no scheduler of ours.

Deployment parameters are stored in Prefect's database and shown in the UI, so they must never hold secrets:
the run config has none (S3 and reward-model credentials come from the environment of the process that runs
the flow, i.e. of `serve` or of the worker).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from sluiceway.infra.errors import UserError

DEFAULT_PORT = 4200
DEFAULT_HOME = Path(".sluiceway") / "prefect"
# What a flow-run process needs besides the worker's own environment (no secrets: job variables are stored).
FLOW_RUN_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def default_api_url(port: int = DEFAULT_PORT) -> str:
    return f"http://127.0.0.1:{port}/api"


def prefect_env(home: str | Path, api_url: str | None = None) -> dict[str, str]:
    """Settings for any Prefect process of ours: home in the project, no telemetry, a quiet console."""
    home = Path(home).resolve()
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "PREFECT_CLI_PROMPT": "false",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _prefect_exe() -> str:
    """The `prefect` script of this environment (the same one sluiceway runs in)."""
    exe = Path(sys.executable).parent / "prefect"
    if exe.exists():
        return str(exe)
    found = shutil.which("prefect")
    if not found:
        raise UserError("the `prefect` command is not installed in this environment")
    return found


def server_command(host: str, port: int) -> list[str]:
    return [_prefect_exe(), "server", "start", "--host", host, "--port", str(port), "--analytics-off"]


def run_server(host: str = "127.0.0.1", port: int = DEFAULT_PORT, home: str | Path = DEFAULT_HOME) -> int:
    """`sluiceway server`: run a Prefect server in the foreground until interrupted."""
    if not 0 < port < 65536:
        raise UserError(f"server: --port {port} is not a TCP port")
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **prefect_env(home))
    env.pop("PREFECT_API_URL", None)  # a server is not a client of another one
    env.update(PREFECT_SERVER_API_HOST=host, PREFECT_SERVER_API_PORT=str(port))
    # The UI asks the server where the API is; without this it points at port 4200 whatever --port says.
    env.setdefault("PREFECT_UI_API_URL", f"http://{host}:{port}/api")
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: the Prefect server listens on {host}, beyond this machine; it has no authentication")
    print(f"Prefect server: UI at http://{host}:{port}, API at http://{host}:{port}/api, home {home}", flush=True)
    print(f"Point clients at it with PREFECT_API_URL=http://{host}:{port}/api", flush=True)
    proc = subprocess.Popen(server_command(host, port), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def check_server(api_url: str) -> None:
    import httpx

    try:
        httpx.get(api_url.rstrip("/") + "/health", timeout=5).raise_for_status()
    except httpx.HTTPError:
        raise UserError(
            f"no Prefect server answers at {api_url}: start one with `sluiceway server` "
            "or set --api-url / PREFECT_API_URL"
        ) from None


def default_parameters(base: dict | None) -> dict:
    """The run config a deployment starts from; relative output directories are made absolute here, so a
    flow run writes where `serve` was started whatever directory the worker runs it in."""
    from sluiceway.flows.config import RunConfig

    if base is None:  # every group at its defaults; the form's user fills in prompt_data
        base = {g: info.annotation().model_dump(mode="json") for g, info in RunConfig.model_fields.items()}
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    storage = base.setdefault("storage", {})
    storage["output_dir"] = str(Path(storage.get("output_dir") or "runs/default").resolve())
    return {"config": base}


FLOW_NAMES = ("rl", "sft", "eval", "replay")  # flows/<short>.py defines <short>_flow


def flows(only: list[str] | None = None) -> dict[str, object]:
    """The flows that get deployments, by short name (those of `only`, if given, that exist)."""
    unknown = sorted(set(only or []) - set(FLOW_NAMES))
    if unknown:
        raise UserError(f"serve: --flow {', '.join(unknown)}: not a flow (choose from {', '.join(FLOW_NAMES)})")
    found: dict[str, object] = {}
    for short in only or FLOW_NAMES:
        try:
            module = importlib.import_module(f"sluiceway.flows.{short}")
        except ModuleNotFoundError as e:
            if e.name != f"sluiceway.flows.{short}":
                raise
            continue
        found[short] = getattr(module, f"{short}_flow")
    return found


def build_deployments(
    base: dict | None,
    name: str = "default",
    cron: str | None = None,
    interval: float | None = None,
    pool: str | None = None,
    only: list[str] | None = None,
) -> list:
    from prefect.deployments.runner import EntrypointType

    rl_params = default_parameters(base)
    job_variables = {"working_dir": str(Path.cwd()), "env": dict(FLOW_RUN_ENV)} if pool else None
    deployments = []
    for short, fl in flows(only).items():
        params = rl_params
        if short == "sft":  # what makes a config an SFT one (as `sluiceway sft` does)
            params = {"config": {**params["config"], "algorithm": {**params["config"].get("algorithm", {})}}}
            params["config"]["algorithm"]["loss_type"] = "sft_loss"
        deployments.append(
            fl.to_deployment(
                name=name,
                cron=cron,
                interval=interval,
                parameters=params,
                tags=["sluiceway", short],
                description=f"sluiceway {short}: the parameter is the run config (see docs/configuration.md).",
                job_variables=job_variables,
                entrypoint_type=EntrypointType.MODULE_PATH,  # the installed package, not a file path
            )
        )
    return deployments


def serve(
    base: dict | None,
    *,
    name: str = "default",
    cron: str | None = None,
    interval: float | None = None,
    pool: str | None = None,
    api_url: str | None = None,
    home: str | Path = DEFAULT_HOME,
    only: list[str] | None = None,
    limit: int | None = None,
) -> list[str]:
    """Register the deployments; serve them here (no pool) or leave them to a work pool's workers."""
    if cron and interval:
        raise UserError("serve: give --cron or --interval, not both")
    if interval is not None and interval <= 0:
        raise UserError(f"serve: --interval {interval} must be a positive number of seconds")
    api_url = api_url or os.environ.get("PREFECT_API_URL") or default_api_url()
    check_server(api_url)
    Path(home).mkdir(parents=True, exist_ok=True)
    # Prefect reads its settings from the environment when imported: set them before the first import.
    os.environ.update(prefect_env(home, api_url))
    for k, v in FLOW_RUN_ENV.items():  # served flow runs are children of this process
        os.environ.setdefault(k, v)
    if cron:
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=cron)
        except ValueError:
            raise UserError(f"serve: --cron '{cron}' is not a cron expression") from None
    # Importing the flows imports megatron, which warns that optional CUDA extensions are missing.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    deployments = build_deployments(base, name, cron, interval, pool, only)
    names = [f"{d.flow_name}/{d.name}" for d in deployments]
    if pool:
        from prefect.deployments.runner import deploy

        with _work_pool_exists(pool, api_url):
            deploy(
                *deployments,
                work_pool_name=pool,
                build=False,
                push=False,
                print_next_steps_message=False,
                ignore_warnings=True,
            )
        print(f"registered {', '.join(names)} on work pool '{pool}'; run them with: prefect worker start --pool {pool}")
        return names
    from prefect import serve as prefect_serve

    print(f"serving {', '.join(names)} from this process (Ctrl-C stops); UI at {api_url.removesuffix('/api')}")
    prefect_serve(*deployments, print_starting_message=False, limit=limit)
    return names


class _work_pool_exists:
    """A clear one-line error when the pool is missing, instead of Prefect's traceback."""

    def __init__(self, pool: str, api_url: str):
        self.pool, self.api_url = pool, api_url

    def __enter__(self):
        import httpx

        r = httpx.get(f"{self.api_url.rstrip('/')}/work_pools/{self.pool}", timeout=10)
        if r.status_code == 404:
            raise UserError(
                f"serve: no work pool '{self.pool}' (create it: prefect work-pool create --type process {self.pool})"
            )
        r.raise_for_status()

    def __exit__(self, *exc):
        return False
