"""Runs that several integration test modules share: one `sluiceway run`, read (or copied) by every test that
asks for it, instead of one identical run per module (the suite's budget, issue 39 point 6)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_run import cli_args, run_cli


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory) -> Path:
    """A sluiceway cache made once per session, from nothing (as on a new machine): tiny-llama built, this CPU's
    precision probe, and the migrated Prefect database every new run directory starts from. Made by a child process
    with the session's environment (the AVX2-only pass probes under its own limits).

    Made once, not once per pytest-xdist worker: the workers of one session share it (the first to need it makes
    it, under a lock, the other waits for it). `make test` names a directory in SLUICEWAY_TEST_SEED_CACHE for its
    main pass and its verifiers pass (same CPU settings, same torch and Prefect): the main pass makes the cache
    there, the verifiers pass copies it (the suite's budget, issue 39 point 6). Nobody writes to it afterwards:
    tests copy it."""
    from filelock import FileLock

    seed = os.environ.get("SLUICEWAY_TEST_SEED_CACHE")
    if seed:
        warm = Path(seed)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        warm = tmp_path_factory.getbasetemp().parent / "warm-cache"  # the workers' common base directory
    else:
        warm = tmp_path_factory.getbasetemp() / "warm-cache"
    done = warm.with_name(warm.name + ".done")
    warm.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(warm) + ".lock"):
        if not done.exists():
            shutil.rmtree(warm, ignore_errors=True)  # a half-made one, from a session that was killed
            warm.mkdir()
            home = tmp_path_factory.mktemp("warm-prefect-home")
            code = (
                "from pathlib import Path; import sys\n"
                "from sluiceway.models.zoo import resolve_checkpoint; resolve_checkpoint('tiny-llama')\n"
                "from sluiceway.models import precision; precision.probe_cpu()\n"
                "from sluiceway.infra.prefect_env import start_api_server; start_api_server(Path(sys.argv[1]))\n"
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"SLUICEWAY_CACHE": str(warm)}
            subprocess.run([sys.executable, "-c", code, str(home)], env=env, check=True, timeout=600,
                           capture_output=True)  # fmt: skip
            assert list((warm / "prefect").glob("template-*.db")), "the Prefect template database was not made"
            done.touch()
    return warm


@pytest.fixture(autouse=True)
def _seeded_cache(request, tmp_path, warm_cache):
    """Every integration test's `tmp_path / "cache"` (the cache its runs use) starts as a copy of the session's
    warm cache: a fresh cache cost each of some 30 runs about 9 s of CPU (the Prefect database's migration, the
    tiny-llama build; the suite's budget, issue 39 point 6). A test that checks first use on an empty cache says
    so with `@pytest.mark.cold_cache`; `make test` runs with an empty HOME, so the session's first build is a first
    use too."""
    if request.node.get_closest_marker("cold_cache") is None:
        shutil.copytree(warm_cache, tmp_path / "cache")


@pytest.fixture(scope="session")
def shared_prefect_api(tmp_path_factory, warm_cache) -> str:
    """One Prefect API server per pytest-xdist worker, the one `sluiceway run` starts for itself
    (infra/prefect_env.py), for the runs of tests marked `shared_prefect`. It dies with the worker."""
    from sluiceway.infra.prefect_env import start_api_server
    from sluiceway.infra.router import stop_process_group

    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLUICEWAY_CACHE", str(warm_cache))  # its template database, only read (copied)
        env.delenv("PREFECT_API_URL", raising=False)
        server = start_api_server(tmp_path_factory.mktemp("shared-prefect"))
    yield server.url
    stop_process_group(server.proc)


@pytest.fixture(autouse=True)
def _prefect_api(request, monkeypatch):
    """A test or module marked `shared_prefect` runs its flows against the worker's shared Prefect server, as a user who
    points PREFECT_API_URL at a server does, instead of each run starting its own: that start, and the imports of
    Prefect's server, are 4-5 s of CPU of a tiny-llama run's 16 (the suite's budget, issue 39 point 6). Only tests
    that check nothing of the run's own server, its database or its processes are marked; those that do
    (signals, kills, credentials, sockets, first use, the Prefect record of a run) start their own, as every run
    without PREFECT_API_URL does. Session and module runs are made before this fixture, with their own server."""
    if request.node.get_closest_marker("shared_prefect") is not None:
        monkeypatch.setenv("PREFECT_API_URL", request.getfixturevalue("shared_prefect_api"))


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory, warm_cache) -> Path:
    """A copy of the session's warm cache for a module's long-lived servers (the Tinker server's), which use their
    cache as it is: the warm cache itself is never written to, other tests copy it."""
    cache = tmp_path_factory.mktemp("module-cache") / "cache"
    shutil.copytree(warm_cache, cache)
    return cache


@pytest.fixture(scope="session")
def two_step_run(tmp_path_factory, warm_cache):
    """A finished 2-step run with cli_run's settings (`run_cli(run_dir, cache, "--num-rollout", "2")`), run id
    "run", and the cache it was made with. Tests never write to it: test_replay_eval.py replays and evaluates it
    into directories of its own, test_faults.py copies it (copy_run) before extending or damaging it."""
    base = tmp_path_factory.mktemp("two-step-run")
    run_dir, cache = base / "run", base / "cache"
    shutil.copytree(warm_cache, cache)  # the session's precision probe: runs compared with it chose the same
    run_cli(run_dir, cache, "--num-rollout", "2")
    return run_dir, cache


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One real Prefect server (`sluiceway server`, tests/prefect_server.py) for the modules that talk to one:
    test_deployments.py (a process work pool and its worker) and test_ui.py (the browser, against `sluiceway serve`
    in place). Each registers deployments and flow runs of its own names; starting the server is about 9 s of CPU
    (the suite's budget, issue 39 point 6)."""
    from prefect_server import PrefectServer

    with PrefectServer(tmp_path_factory.mktemp("prefect")) as server:
        yield server


@pytest.fixture(scope="session")
def dp2_cli_run(tmp_path_factory, warm_cache):
    """`sluiceway run --num-rollout 2 --actor-num-gpus-per-node 2 --use-distributed-optimizer` with cli_run's
    settings (a DP=2 torchrun group with the sharded optimizer), run with this machine's LAN address as hostname
    where the kernel allows, every listening socket of its processes sampled until it ended
    (test_loopback_sockets.run_sampling_sockets). test_distributed_optimizer.py checks its training and
    checkpoint, test_loopback_sockets.py its sockets."""
    from test_loopback_sockets import run_sampling_sockets

    base = tmp_path_factory.mktemp("dp2-run")
    shutil.copytree(warm_cache, base / "cache")
    run_dir = base / "run"
    cmd = cli_args(run_dir, "--num-rollout", "2", "--actor-num-gpus-per-node", "2", "--use-distributed-optimizer")
    env = dict(os.environ, SLUICEWAY_CACHE=str(base / "cache"))
    returncode, sockets = run_sampling_sockets(cmd, env, base / "run")
    stdout, stderr = (Path(f"{base / 'run'}.{name}").read_text() for name in ("stdout", "stderr"))
    return SimpleNamespace(run_dir=run_dir, returncode=returncode, sockets=sockets, stdout=stdout, stderr=stderr)
