"""`--prompt-data verifiers:NAME`: an environment written for Prime Intellect's verifiers (its v1 API, verifiers
0.4.0), trained unchanged.

NAME is what verifiers itself calls a taskset id: an installed package or importable module that exports its
`vf.Taskset` subclass in `__all__` (and optionally its own `vf.Env` or `vf.Harness`). The run's
`data.verifiers_env` is verifiers' own `[env]` block as a dict (the taskset's arguments under `taskset`, the
single agent's harness under `agent.harness`, `timeout`, ...); `taskset.id` is NAME. The environment is built
with verifiers' `resolve_env_config` and `load_environment`, exactly as its own `eval` does.

Its tasks become the prompt rows (this module); each sample runs one of its episodes against the sample's agent
session (tasks/rollout/agent/verifiers.py). verifiers is imported only here and there, lazily: a run without a
`verifiers:` source never imports it. Mistakes (verifiers missing, its v0 API, an unknown NAME, arguments its
config refuses, a taskset that raises while loading) are one UserError line, before the engines start.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
import sys
from typing import Any

from sluiceway.infra.errors import UserError
from sluiceway.infra.prompt_sources import VERIFIERS, source_body, source_kind

VERSION = "0.4.0"  # the verifiers release whose v1 API this adapter follows (pyproject's `verifiers` extra)
DEFAULT_EPISODE_TIMEOUT_S = 900.0  # verifiers' `timeout.episode` when data.verifiers_env leaves it unset
_NAME = re.compile(r"^[A-Za-z0-9_.\-/@]+$")


def is_verifiers_source(source: str | None) -> bool:
    return source_kind(source) == VERIFIERS


def env_name(source: str) -> str:
    name = source_body(source).strip()
    if not name or not _NAME.match(name):
        raise UserError(f"--prompt-data {source}: expected verifiers:NAME, NAME a taskset package or module")
    return name


def import_v1(source: str):
    """verifiers' v1 API (`verifiers.v1`), or one line saying why it cannot be used."""
    try:
        import verifiers
    except ImportError as e:
        raise UserError(
            f"--prompt-data {source}: verifiers is not installed ({e}); install the extra: "
            f"pip install 'sluiceway[verifiers]' (verifiers=={VERSION})"
        ) from None
    version = getattr(verifiers, "__version__", "unknown")
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "verifiers.v1":
            raise UserError(
                f"--prompt-data {source}: verifiers {version} has no v1 API (verifiers.v1); only the v1 API of "
                f"verifiers {VERSION} is supported, not the v0 API of 0.3.x: pip install verifiers=={VERSION}"
            ) from None
        raise UserError(f"--prompt-data {source}: importing verifiers.v1 failed: {type(e).__name__}: {e}") from None
    missing = [n for n in ("load_environment", "resolve_env_config", "ModelContext", "EvalClientConfig")
               if not hasattr(vf, n)]  # fmt: skip
    if missing:
        raise UserError(f"--prompt-data {source}: verifiers {version}'s v1 API lacks {', '.join(missing)}; "
                        f"verifiers {VERSION} is the version supported")  # fmt: skip
    return vf


def env_config(name: str, args: dict | None) -> dict:
    """verifiers' `[env]` block for NAME: `args` with `taskset.id` set and an episode deadline by default."""
    cfg = json.loads(json.dumps(args or {}))  # a deep copy, and only JSON's types
    taskset = cfg.get("taskset")
    if taskset is None:
        taskset = cfg["taskset"] = {}
    if not isinstance(taskset, dict):
        raise UserError(f"data.verifiers_env.taskset must be a mapping of the taskset's arguments, got {taskset!r}")
    if taskset.get("id") not in (None, name):
        raise UserError(f"data.verifiers_env.taskset.id is {taskset['id']!r} but --prompt-data names {name!r}")
    taskset["id"] = name
    timeout = cfg.setdefault("timeout", {})
    if isinstance(timeout, dict) and timeout.get("episode") is None:
        timeout["episode"] = DEFAULT_EPISODE_TIMEOUT_S
    return cfg


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"


def _module_name(name: str) -> str:
    """The module verifiers imports for a taskset id (`owner/name@version` -> `name`, dashes as underscores)."""
    return name.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _names_module(name: str, missing: str) -> bool:
    """Whether `missing` (a ModuleNotFoundError's name) is NAME's own module or its verifiers.v1.tasksets twin."""
    module = _module_name(name)
    return missing in (module, f"verifiers.v1.tasksets.{module}") or module.startswith(missing + ".")


def _v0_module(name: str) -> bool:
    """NAME imports as a module with verifiers 0.3.x's entry point (`load_environment()`) and no v1 Taskset."""
    import importlib

    try:
        module = importlib.import_module(_module_name(name))
    except Exception:  # noqa: BLE001 - only a hint for the error line
        return False
    return callable(getattr(module, "load_environment", None)) and not getattr(module, "__all__", None)


@functools.lru_cache(maxsize=8)
def _load(source: str, cfg_json: str):
    vf = import_v1(source)
    name = env_name(source)
    try:
        config = vf.resolve_env_config(json.loads(cfg_json))
    except ModuleNotFoundError as e:
        cause = e.__cause__
        if isinstance(cause, ModuleNotFoundError) and cause.name and not _names_module(name, cause.name):
            # NAME was found, and a module it imports was not: say which (verifiers' line says NAME is missing)
            raise UserError(f"--prompt-data {source}: importing {name} failed: {_one_line(cause)}") from None
        raise UserError(f"--prompt-data {source}: {' '.join(str(e).split())[:400]}") from None
    except (AttributeError, TypeError) as e:
        hint = (" (it looks like a verifiers v0 environment, 0.3.x's load_environment(): only the v1 API is "
                "supported)") if _v0_module(name) else ""  # fmt: skip
        raise UserError(f"--prompt-data {source}: not a verifiers v1 taskset: {_one_line(e)}{hint}") from None
    except ValueError as e:  # pydantic's ValidationError is one
        raise UserError(f"--prompt-data {source}: data.verifiers_env refused: {_one_line(e, 500)}") from None
    except Exception as e:  # noqa: BLE001 - importing the environment's own code (a SyntaxError, an ImportError)
        raise UserError(f"--prompt-data {source}: importing {name} failed: {_one_line(e)}") from None
    config = _local_runtimes(vf, source, config, json.loads(cfg_json))
    try:
        env = vf.load_environment(config)
    except Exception as e:  # noqa: BLE001 - the environment's own code: its failure is the user's to see
        raise UserError(f"--prompt-data {source}: loading the environment raised {_one_line(e)}") from None
    use_local_python_for_scripts()
    return env


def _local_runtimes(vf, source: str, config, raw: dict):
    """Every agent role on the local subprocess runtime unless data.verifiers_env names another local one:
    verifiers' default is Prime's remote sandbox (an account, the network), which a run here never uses."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import runtime_is_local

    changed = False
    for role, agent in agent_config_fields(config).items():
        given = raw.get(role, {}).get("runtime") if isinstance(raw.get(role), dict) else None
        if given is None:
            raw.setdefault(role, {})
            if not isinstance(raw[role], dict):
                raw[role] = {}
            raw[role]["runtime"] = {"type": "subprocess"}
            changed = True
        elif not runtime_is_local(agent.runtime):
            raise UserError(
                f"--prompt-data {source}: data.verifiers_env.{role}.runtime is {agent.runtime.type!r}, "
                "a remote sandbox; only local runtimes are supported (subprocess, the default here)"
            )
    return vf.resolve_env_config(raw) if changed else config


def load_env(source: str, args: dict | None):
    """The environment (a `vf.Env`) for `verifiers:NAME` and data.verifiers_env, built once per process."""
    return _load(source, json.dumps(env_config(env_name(source), args), sort_keys=True))


def table_name(source: str, args: dict | None, size: int) -> str:
    """The dataset table of a verifiers source: its NAME, a digest of its arguments, how many tasks."""
    digest = hashlib.sha256(json.dumps(args or {}, sort_keys=True).encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", env_name(source))
    return f"datasets/verifiers-{safe}-{digest}-n{size}"


def tasks(env, size: int) -> list:
    """The first `size` tasks of the environment's taskset, in its own order (its `idx`)."""
    try:
        return list(itertools.islice(iter(env.taskset), size))
    except Exception as e:  # noqa: BLE001 - the taskset's own code
        raise UserError(f"the verifiers taskset's load() raised {_one_line(e)}") from None


def task_at(env, cache: dict[int, Any], idx: int, size: int | None) -> Any:
    """The taskset's task `idx`; `cache` holds the tasks loaded so far (the taskset's load() runs once for the
    dataset's `size` tasks: it may read a dataset). ValueError for a task the taskset does not have."""
    if idx not in cache:
        for task in tasks(env, max(idx + 1, size or 0)):
            cache.setdefault(task.data.idx, task)
    task = cache.get(idx)
    if task is None:
        raise ValueError(f"the taskset has no task {idx}")
    return task


def prompt_of(task) -> str | list[dict]:
    """A task's prompt as a dataset row holds it: its text, or its messages as chat dicts."""
    prompt = task.data.prompt
    if prompt is None or isinstance(prompt, str):
        text = prompt or ""
        if task.data.system_prompt:
            return [{"role": "system", "content": task.data.system_prompt}, {"role": "user", "content": text}]
        return text
    messages = [m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt]
    if task.data.system_prompt:
        messages.insert(0, {"role": "system", "content": task.data.system_prompt})
    return messages


def records(source: str, args: dict | None, size: int) -> list[dict[str, Any]]:
    """The dataset rows of a verifiers source: one per task (at most `size`); the task's `idx` and `key` in the
    metadata name it again at rollout."""
    env = load_env(source, args)
    out = []
    for task in tasks(env, size):
        meta = {"verifiers": {"env": env_name(source), "idx": task.data.idx, "key": task.key}}
        if task.data.id is not None:
            meta["verifiers"]["id"] = task.data.id
        label = task.data.id if task.data.id is not None else task.key  # the task's name; its data stays in verifiers'
        out.append({"input": prompt_of(task), "label": label, "metadata": meta})
    if not out:
        raise UserError(f"--prompt-data {source}: the taskset holds no tasks")
    return out


# ------------------------------------------------------------------------------------ harness scripts, offline
def _script_requirements(script: str) -> list[str] | None:
    """The `dependencies` of a PEP 723 script's metadata block, or None when it has none to read."""
    import tomllib

    m = re.search(r"(?ms)^# /// script\s*$\n(.*?)^# ///\s*$", script)
    if m is None:
        return None
    body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in m.group(1).splitlines())
    try:
        return list(tomllib.loads(body).get("dependencies") or [])
    except (tomllib.TOMLDecodeError, TypeError):
        return None


def unmet_requirements(requirements: list[str]) -> list[str]:
    """Those of `requirements` this Python's installed distributions do not satisfy."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    unmet = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            unmet.append(text)
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            unmet.append(text)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(text)
    return unmet


def use_local_python_for_scripts() -> None:
    """verifiers' harnesses (its `null` and `bash` chat loops among them) run their agent program as a PEP 723
    script prepared by `uv sync --script`, which installs uv and the script's dependencies from the package index
    at first use. On the local (subprocess) runtime, a script whose dependencies this Python already satisfies
    (the `verifiers` extra installs them: openai, mcp, httpx, ...) runs with this Python instead: it is written to
    the path verifiers would use and registered as prepared, so no uv and no network. Any other script goes the
    way verifiers takes it."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    original = SubprocessRuntime.prepare_uv_script
    if getattr(original, "sluiceway_local_python", False):  # wrapped once per process (the mark is on the class)
        return

    async def prepare_uv_script(self, script, env=None, *, activate: bool = True):
        text = script.decode() if isinstance(script, bytes) else script
        reqs = _script_requirements(text)
        if reqs is not None and not unmet_requirements(reqs):
            digest = hashlib.sha256(text.encode()).hexdigest()
            directory = self.scripts_dir if self.user is None else f"{self.scripts_dir}-{self.user}"
            path = f"{directory}/{digest}.py"
            if path not in self._uv_interpreters:
                os.makedirs(directory, exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
                self._uv_interpreters[path] = sys.executable
        return await original(self, script, env, activate=activate)

    prepare_uv_script.sluiceway_local_python = True
    SubprocessRuntime.prepare_uv_script = prepare_uv_script
