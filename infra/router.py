"""sglang-router (0.3.2, the Rust "SGLang Model Gateway") as a process this code owns.

    with SGLangRouter(log_dir) as router:
        router.add_worker("http://127.0.0.1:31001")
        ...  # POST {router.url}/generate

Facts measured on 0.3.2 with a stub worker (they shape the code below):
- Launch: ``python -m sglang_router.launch_router`` (= the ``sglang-router launch`` / ``smg launch`` console
  scripts). Initial workers: ``--worker-urls URL [URL ...]``; with none it starts empty (in about 1 s) and
  ``GET /health`` answers 200 at once; ``/readiness`` stays 503 until a healthy worker exists. The process
  renames itself ``sglang::router`` (setproctitle), so never look for it by command line: we keep its pid and
  kill its process group. A busy ``--prometheus-port`` makes it panic and exit ("failed to install Prometheus
  metrics exporter"): every router gets its own port.
- Workers: ``POST /workers {"url": u}`` answers 202 ``{"worker_id": <uuid>, ...}`` and registers in the
  background (health, ``/server_info``, ``/model_info``, tokenizer); the worker shows in ``GET /workers`` only
  once that finished, so :meth:`add_worker` polls. An unreachable URL is retried for
  ``--worker-startup-timeout-secs`` and never listed meanwhile. Posting a URL already registered returns the
  existing id (no duplicate). Ids are random UUIDs per registration, not derived from the URL;
  ``DELETE /workers/{uuid}`` (202, background) is the only removal, a URL there is a 400.
  ``model_id`` comes from the worker's ``served_model_name``; its ``tokenizer_path``/``model_path`` is loaded
  as a tokenizer: a path that does not exist on the router's machine is taken for a hub name and fetched from
  the internet (it fails offline and only warns; routing is unaffected).
- Health: every ``--health-check-interval-secs`` (default 60) it GETs ``/health``; after
  ``--health-failure-threshold`` misses the worker is marked ``is_healthy: false`` and skipped, but it is NOT
  removed (it comes back healthy after ``--health-success-threshold`` good checks). Removal is our job
  (:class:`sluiceway.infra.engine_group.EngineGroup.check`).
- Retries: a connection refused, a connection dropped mid-request (worker SIGKILLed) or a 5xx from a worker is
  retried on another worker with the same body, so the same ``rid`` (up to ``--retry-max-retries``, default 5,
  exponential backoff from 50 ms); a dead engine may thus have seen a request another one answers. 4xx passes
  through unchanged. With no healthy worker: 503 ``no_available_workers``; retries exhausted: 500.
- Circuit breaker: every non-2xx answer, 4xx included, counts as a worker failure; after
  ``--cb-failure-threshold`` (10) the worker is skipped for ``--cb-timeout-duration-secs`` (60 s) and, once all
  are, every request gets 503. Ten bad requests (say, prompts over the context length) would take a healthy
  group down for a minute, so it is off by default here (``circuit_breaker=False``): dead engines are still
  skipped by the health checks and retried around, and ``EngineGroup.check`` removes them.
- ``/generate`` is parsed into a typed request and re-serialised: ``input_ids``, ``text``, ``rid``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``stream`` and the common
  ``sampling_params`` (temperature, top_p, top_k, min_p, max_new_tokens, min_new_tokens, stop, stop_token_ids,
  ignore_eos, skip_special_tokens, no_stop_trim, n, penalties, regex, ``sampling_seed``) pass unchanged;
  unknown fields are dropped (top level: e.g. ``lora_path``, ``custom_logit_processor``,
  ``return_routed_experts``; sampling: ``custom_params``, ``logit_bias``, ``spaces_between_special_tokens``)
  and defaults are added (``model: null``, ``log_metrics``, ``return_hidden_states``, ``background``,
  ``no_logs``, ``return_bytes``, ``return_entropy``, ``return_text_in_logprobs``, ``stream``), so an engine
  must accept those at their defaults. The response body (JSON or SSE stream) comes back byte-for-byte, extra fields and
  all. ``/v1/chat/completions`` is forwarded (translated, e.g. ``max_tokens`` -> ``max_completion_tokens``).
- Other endpoints: ``/flush_cache`` is fanned out to every worker; ``/get_model_info`` goes to one worker;
  ``/get_server_info`` is the router's own; ``/model_info``, ``/server_info``, ``/pause_generation``,
  ``/continue_generation``, ``/update_weights_from_disk``, ``/abort_request`` are 404: control calls go to each
  engine directly (:class:`sluiceway.tasks.rollout.client.EngineClient`).

Policy: ``manual`` with ``--assignment-mode min_group`` by default. A request that carries an
``X-SMG-Routing-Key`` header goes where the first request with that key went; a new key goes to the engine
holding the fewest active keys. The rollout sends each GRPO group's samples under one key, so a group's
samples share one engine's prefill of their prompt (our engine shares it across the group; SGLang's radix cache
does the same) and the groups spread evenly. Requests without a key go to a random engine. ``round_robin``
splits a group over the engines (each then prefills its prompt), and ``cache_aware`` (the router's own default)
sends a request to the engine whose prefix tree matches best unless loads differ by more than
``--balance-abs-threshold`` (64) requests: measured with ``input_ids``-only requests, 8 requests with 8
different prompts all went to one of two engines. ``random`` also works; ``power_of_two`` refuses to start
without 2 initial workers.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

from sluiceway.infra.proc import child_env, die_with_parent, free_port

HOST = "127.0.0.1"
# power_of_two is left out: 0.3.2 refuses to start it with fewer than 2 workers, and we start empty.
POLICIES = ("manual", "round_robin", "cache_aware", "random")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # what the manual policy routes by


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group started with ``start_new_session``, SIGKILL it if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # also reaps children that outlived their leader
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def log_tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class RouterError(RuntimeError):
    pass


class SGLangRouter:
    """Owns one sglang-router process, on 127.0.0.1 unless ``host`` says otherwise (a pool that runs in another
    place than its runs: flows/pools.py); workers are added and removed over its HTTP API."""

    def __init__(
        self,
        log_dir: str | Path,
        policy: str = "manual",
        port: int | None = None,
        health_check_interval_s: int = 5,
        health_failure_threshold: int = 2,
        max_retries: int = 5,
        request_timeout_s: int = 1800,
        worker_startup_timeout_s: int = 300,
        circuit_breaker: bool = False,
        startup_timeout_s: float = 120.0,  # 30 s was passed on a 2-core machine running a test suite and a benchmark
        extra_args: tuple[str, ...] = (),
        host: str = HOST,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.log_dir = Path(log_dir)
        self.policy = policy
        self.port = port
        self.host = host  # where it listens (its metrics stay on loopback)
        self.health_check_interval_s = health_check_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.worker_startup_timeout_s = worker_startup_timeout_s
        self.circuit_breaker = circuit_breaker
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.prometheus_port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path = self.log_dir / "router.log"
        self._http = httpx.Client(timeout=10.0, trust_env=False)  # never via a proxy: it is loopback

    @property
    def url(self) -> str:
        if self.port is None:
            raise RouterError("router is not started")
        host = HOST if self.host in ("0.0.0.0", "::") else self.host  # every address: reach it on loopback
        return f"http://{host}:{self.port}"

    def _command(self, port: int, prometheus_port: int) -> list[str]:
        return [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", self.host, "--port", str(port),
            "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port),
            "--policy", self.policy,
            *(("--assignment-mode", "min_group") if self.policy == "manual" else ()),
            "--health-check-interval-secs", str(self.health_check_interval_s),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--retry-max-retries", str(self.max_retries),
            "--request-timeout-secs", str(self.request_timeout_s),
            "--worker-startup-timeout-secs", str(self.worker_startup_timeout_s),
            "--log-level", "warn",
            *(() if self.circuit_breaker else ("--disable-circuit-breaker",)),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> Self:
        if self.process is not None:
            return self
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fixed = self.port is not None
        for attempt in range(1 if fixed else 3):  # a chosen port can be taken before the router binds it
            port = self.port if fixed else free_port()
            self.prometheus_port = free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    self._command(port, self.prometheus_port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env(),  # no credentials (infra/proc.py)
                    start_new_session=True,  # its own process group, so stop() takes everything it spawned
                    preexec_fn=die_with_parent,  # a SIGKILLed flow leaves no engines behind
                )
            self.port = port
            atexit.register(self.stop)
            try:
                self._wait_ready()
                return self
            except RouterError:
                self.stop()
                lost_race = "in use" in log_tail(self.log_path)  # "Address already in use"
                if fixed or attempt == 2 or not lost_race:
                    raise
                self.port = None
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RouterError(
                    f"sglang-router exited with code {self.process.returncode}; log {self.log_path}:\n"
                    + log_tail(self.log_path)
                )
            try:
                if self._http.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RouterError(f"sglang-router not ready in {self.startup_timeout_s:.0f}s; log {self.log_path}")

    def stop(self) -> None:
        if self.process is None:
            return
        stop_process_group(self.process)
        self.process = None
        atexit.unregister(self.stop)

    def close(self) -> None:
        self.stop()
        self._http.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- workers -------------------------------------------------------------------------------------------

    def workers(self) -> list[dict]:
        """The router's view: dicts with ``id``, ``url``, ``is_healthy``, ``load``, ``model_id``, ..."""
        r = self._http.get(f"{self.url}/workers")
        r.raise_for_status()
        return r.json()["workers"]

    def worker_urls(self) -> list[str]:
        return [w["url"] for w in self.workers()]

    def _find(self, url: str) -> dict | None:
        url = url.rstrip("/")
        return next((w for w in self.workers() if w["url"].rstrip("/") == url), None)

    def add_worker(self, url: str, timeout_s: float = 60.0) -> str:
        """Register ``url`` and wait until the router lists it healthy; returns the router's worker id."""
        url = url.rstrip("/")
        r = self._http.post(f"{self.url}/workers", json={"url": url})
        if r.status_code >= 400:
            raise RouterError(f"router refused worker {url}: {r.status_code} {r.text}")
        deadline = time.monotonic() + timeout_s
        while True:  # registration runs in the background: poll the listing
            w = self._find(url)
            if w is not None and w.get("is_healthy", True):
                return w["id"]
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} not registered by the router in {timeout_s:.0f}s; log {self.log_path}")
            time.sleep(0.1)

    def worker_outcomes(self) -> dict[str, dict[str, int]]:
        """Per worker URL, request outcomes as the router counted them (``{"success": n, "failure": m}``),
        from its Prometheus ``smg_worker_cb_outcomes_total``: who served how much, whatever the engine."""
        r = self._http.get(f"http://{HOST}:{self.prometheus_port}/metrics")
        r.raise_for_status()
        out: dict[str, dict[str, int]] = {}
        for m in re.finditer(r'^smg_worker_cb_outcomes_total\{worker="([^"]+)",outcome="(\w+)"\} (\S+)$', r.text, re.M):
            out.setdefault(m[1], {})[m[2]] = int(float(m[3]))
        return out

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> bool:
        """Deregister ``url`` (by its id) and wait until it is gone; False if it was not registered."""
        w = self._find(url)
        if w is None:
            return False
        r = self._http.delete(f"{self.url}/workers/{w['id']}")
        if r.status_code >= 400 and r.status_code != 404:
            raise RouterError(f"router refused to remove worker {url}: {r.status_code} {r.text}")
        deadline = time.monotonic() + timeout_s
        while self._find(url) is not None:
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} still registered {timeout_s:.0f}s after DELETE")
            time.sleep(0.1)
        return True
