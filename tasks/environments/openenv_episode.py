"""OpenEnv environments as rollouts: `--prompt-data openenv:URL` (a running environment server) or
`--prompt-data openenv:MODULE:Class` (an environment class the run serves on loopback with openenv's `create_app`).

Each sample is one episode, run as an agent session (tasks/rollout/agent/): the episode's driver below talks to
the session's token-recording endpoint like any agent, so the row's tokens, mask and log-probs are what the engine
was sent and answered, turn by turn, and the observations (text the model did not write) are masked out.

    reset(seed) -> observation -> user message
    repeat: model turn -> action(s) -> step -> observation -> tool (or user) message ... until done

- Actions as tools (the default), as TRL's `environment_factory` offers an environment's methods: the
  environment's action model (its JSON schema from the server's /schema, less the base class's `metadata`) is
  one function tool named after the model's class (`GuessAction` -> `guess`); each call's arguments are one
  action, its observation the tool's answer. A turn without a call ends the episode.
  An MCP environment (openenv's MCPEnvironment: its action model is `Action` itself or `CallToolAction`) offers
  its MCP tools instead: listed with a `list_tools` action after reset, each call a `call_tool` action, the
  tool's text (or its error) the answer.
- Or parsed: `--openenv-action-parser module:fn`, fn(text) -> the action's fields (a dict), or None to end the
  episode; observations come back as user messages.

The sample's reward is the episode's return: the sum of its steps' rewards (None counts 0). The row's
reward_details hold {"source": "openenv", "rewards": [...per step], "done", "steps", "refused_actions"}.
An environment that fails (its server dies or closes the connection, an answer later than
--openenv-timeout-s, an exception in its reset or step, a reward that is not a number) fails the sample: status
aborted, the reason in metadata.abort_reason; the run goes on, and a served environment whose server died is
started again for the next session. Protocol: openenv_client.py; serving: openenv_servers.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from sluiceway.infra.errors import UserError
from sluiceway.storage.trajectories import reward_problem
from sluiceway.tasks.environments.openenv_client import (
    ActionRefused,
    AnswerTimeout,
    CapacityReached,
    EnvironmentFailed,
    OpenEnvSession,
    StepResult,
)

log = logging.getLogger("sluiceway")
DETAILS_KEY = "_openenv_episode"  # the prompt metadata key that ties an episode's details to its sample


# ------------------------------------------------------------------------------------------- the dataset
def openenv_records(spec: str, n: int, seed: int) -> list[dict]:
    """n episodes: each record a reset seed (a group's samples all reset with their prompt's seed, so a GRPO
    group compares the same episode)."""
    rng = random.Random(f"openenv:{seed}")
    out = []
    for i in range(n):
        s = rng.randrange(2**31)
        out.append({"input": f"OpenEnv episode, reset seed {s}", "label": "",
                    "metadata": {"openenv": spec, "seed": s, "index": i}})  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------- the action tool
def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def action_tool(schema: dict) -> dict:
    """The function tool for an action model's JSON schema (pydantic's): its fields, less `metadata`."""
    title = str(schema.get("title") or "Action")
    name = _snake(title[: -len("Action")] if title.endswith("Action") and title != "Action" else title)
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:64] or "act"
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    params: dict[str, Any] = {"type": "object", "properties": props}
    required = [k for k in schema.get("required") or [] if k != "metadata"]
    if required:
        params["required"] = required
    if schema.get("$defs"):
        params["$defs"] = schema["$defs"]
    description = schema.get("description") or f"Take one action in the environment ({title})."
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def is_mcp(schema: dict | None) -> bool:
    """An action model that is openenv's base `Action` (no fields but metadata) or its MCP `CallToolAction`."""
    props = set((schema or {}).get("properties") or {}) - {"metadata"}
    return not props or {"tool_name", "arguments"} <= props


def mcp_tools(observation: dict) -> list[dict]:
    """A ListToolsObservation's tools as function tools."""
    out = []
    for t in observation.get("tools") or []:
        if isinstance(t, dict) and isinstance(t.get("name"), str):
            params = t.get("input_schema") if isinstance(t.get("input_schema"), dict) else {"type": "object"}
            out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                         "parameters": params}})  # fmt: skip
    return out


def mcp_text(observation: dict) -> str:
    """A CallToolObservation as the tool's answer: its text content, or its error."""
    err = observation.get("error")
    if isinstance(err, dict) and err.get("message"):
        return f"Error: {err['message']}"
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [c.get("text") for c in result["content"] if isinstance(c, dict) and isinstance(c.get("text"), str)]
        if texts:
            return "\n".join(texts)
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


def observation_text(observation: dict) -> str:
    """An observation as the model reads it: its one text field, or its fields as JSON (less reward/done/metadata)."""
    fields = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, ensure_ascii=False, default=str)


def _reward(value: Any, where: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        raise EnvironmentFailed(f"the environment's reward at {where} is not a number: {value!r}"[:300])
    problem = reward_problem(value)
    if problem is not None:
        raise EnvironmentFailed(f"the environment's reward at {where} is a {problem}")
    return float(value)


# ------------------------------------------------------------------------------------------- the episode
@dataclasses.dataclass
class EpisodeOptions:
    action_parser: Callable[[str], Any] | None = None
    observation_text: Callable[[dict], Any] | None = None
    max_turns: int = 16
    turn_tokens: int | None = None  # a model turn's max_tokens (None: what is left of the session's budget)
    timeout_s: float = 60.0
    system_prompt: str | None = None


class _Abort(Exception):
    pass


class OpenEnvEpisodes:
    """The agent function (tasks/rollout/agent/proxy.py) that plays one episode per call."""

    def __init__(self, servers, action_schema: dict | None, options: EpisodeOptions):
        self.servers = servers  # .session() -> async context manager yielding a server URL; .hung(url)
        self.options = options
        tools_mode = options.action_parser is None and action_schema is not None
        self.mcp = tools_mode and is_mcp(action_schema)
        self.tools = [action_tool(action_schema)] if tools_mode and not self.mcp else None
        self.details: dict[str, dict] = {}

    def _text(self, res: StepResult) -> str:
        fn = self.options.observation_text
        if fn is None:
            return mcp_text(res.observation) if self.mcp else observation_text(res.observation)
        try:
            text = fn(res.observation)
        except Exception as e:  # noqa: BLE001 - the user's function: the sample fails with the reason
            raise _Abort(f"--openenv-observation-text raised {type(e).__name__}: {str(e)[:200]}") from None
        return text if isinstance(text, str) else json.dumps(text, default=str)

    async def __call__(self, base_url: str, api_key: str, prompt: dict) -> float | None:
        meta = prompt.get("metadata") or {}
        token = meta.get(DETAILS_KEY)
        d = {"source": "openenv", "rewards": [], "done": False, "steps": 0, "refused_actions": 0}
        session_url = base_url.removesuffix("/v1")
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(3600.0, connect=30.0), trust_env=False,
            headers={"Authorization": f"Bearer {api_key}"},
        ) as http:  # fmt: skip
            try:
                reward = await self._play(http, base_url, meta, d)
            except (EnvironmentFailed, _Abort) as e:
                reason = f"openenv: {e}"
                try:
                    await http.post(f"{session_url}/abort", json={"reason": reason[:500]})
                except httpx.HTTPError:
                    pass
                return None
            finally:
                if token:
                    self.details[token] = d
        return reward

    async def _play(self, http: httpx.AsyncClient, base_url: str, meta: dict, d: dict) -> float | None:
        o = self.options
        async with self.servers.session() as url:
            env = OpenEnvSession(url, timeout_s=o.timeout_s)
            try:
                reset_kwargs = {"seed": meta["seed"]} if isinstance(meta.get("seed"), int) else {}
                res = await self._reset(env, reset_kwargs)
                _reward(res.reward, "reset")
                if res.done:
                    raise _Abort("the episode was done at reset, before any action")
                first = observation_text(res.observation) if o.observation_text is None else self._text(res)
                tools = self.tools
                if self.mcp:  # the environment's MCP tools (a list_tools action is no step of the episode)
                    listed = await env.step({"type": "list_tools"}, n=0)
                    tools = mcp_tools(listed.observation)
                    if not tools:
                        raise EnvironmentFailed("the environment's list_tools answered no tools")
                messages = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
                messages.append({"role": "user", "content": first})
                for _ in range(o.max_turns):
                    msg, finish = await self._model_turn(http, base_url, messages, tools)
                    if msg is None:
                        return None  # the session ended (the run cut it short): nothing to score
                    messages.append(msg)
                    if finish == "length" and not msg["content"] and not msg.get("tool_calls"):
                        break  # the session's token budget is spent: answered without a model turn
                    new, acted = await self._act(env, msg, d, tools)
                    if d["done"] or not acted:
                        break
                    messages += new
            except AnswerTimeout:
                self.servers.hung(url)
                raise
            finally:
                await env.close()
        total = sum(d["rewards"])
        if reward_problem(total) is not None:
            raise EnvironmentFailed(f"the episode's return {total!r} is not a finite float32")
        return total

    async def _reset(self, env: OpenEnvSession, kwargs: dict) -> StepResult:
        """Connect and reset; a server at its capacity (a running one, openenv:URL) is tried again every half second
        for up to its `wait_s`."""
        end = time.monotonic() + getattr(self.servers, "wait_s", 0.0)
        while True:
            await env.open()
            try:
                return await env.reset(**kwargs)
            except CapacityReached:
                await env.close()
                if time.monotonic() >= end:
                    raise
                await asyncio.sleep(0.5)

    async def _model_turn(self, http, base_url: str, messages: list[dict], tools) -> tuple[dict | None, str | None]:
        body: dict[str, Any] = {"model": "policy", "messages": messages}
        if tools:
            body["tools"] = tools
        if self.options.turn_tokens:
            body["max_tokens"] = self.options.turn_tokens
        r = await http.post(f"{base_url}/chat/completions", json=body)
        if r.status_code == 409:
            return None, None
        if r.status_code != 200:
            try:
                why = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = r.text[:200]
            raise _Abort(f"the model call was answered {r.status_code}: {why}")
        choice = r.json()["choices"][0]
        m = choice["message"]
        msg = {"role": "assistant", "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]
        return msg, choice.get("finish_reason")

    async def _step(self, env: OpenEnvSession, action: Any, d: dict) -> tuple[StepResult | None, str | None]:
        """(result, None), or (None, why) when the server refused the action (the model's mistake)."""
        if not isinstance(action, dict):
            return None, f"an action is a JSON object of the action's fields, got {json.dumps(action, default=str)}"
        try:
            res = await env.step(action, n=d["steps"] + 1)
        except ActionRefused as e:
            d["refused_actions"] += 1
            return None, str(e)
        d["steps"] += 1
        d["rewards"].append(_reward(res.reward, f"step {d['steps']}"))
        d["done"] = res.done
        return res, None

    async def _act(self, env: OpenEnvSession, msg: dict, d: dict, tools) -> tuple[list[dict], bool]:
        """The turn's actions stepped: (the messages that answer them, whether there was any action)."""
        if self.options.action_parser is not None:
            try:
                action = self.options.action_parser(msg["content"])
            except Exception as e:  # noqa: BLE001 - the user's function
                raise _Abort(f"--openenv-action-parser raised {type(e).__name__}: {str(e)[:200]}") from None
            if action is None:
                return [], False
            res, refused = await self._step(env, action, d)
            return [{"role": "user", "content": f"Invalid action: {refused}" if refused else self._text(res)}], True
        calls = msg.get("tool_calls") or []
        names = [t["function"]["name"] for t in tools or []]
        out = []
        for call in calls:
            fn = call.get("function") or {}
            if fn.get("name") not in names:
                text = f"Error: unknown tool {fn.get('name')!r}; the tools are {', '.join(map(repr, names))}"
            else:
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = None
                if self.mcp and isinstance(args, dict):
                    args = {"type": "call_tool", "tool_name": fn["name"], "arguments": args}
                res, refused = await self._step(env, args, d)
                text = f"Error: invalid action: {refused}" if refused else self._text(res)
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": text})
            if d["done"]:
                break
        return out, bool(calls)


class OpenEnvGenerate:
    """The run's generate function for an openenv: source: an agent session per sample playing one episode."""

    def __init__(self, servers, action_schema: dict | None, options: EpisodeOptions):
        from sluiceway.tasks.rollout.agent.proxy import AgentGenerate

        self.servers = servers
        self.episodes = OpenEnvEpisodes(servers, action_schema, options)
        self.agent = AgentGenerate(self.episodes.__call__)  # a bound coroutine function: run on the endpoint loop

    async def __call__(self, ctx, prompt, params):
        token = uuid.uuid4().hex
        tagged = dataclasses.replace(prompt, metadata={**(prompt.metadata or {}), DETAILS_KEY: token})
        try:
            buf = await self.agent(ctx, tagged, params)
        finally:
            details = self.episodes.details.pop(token, None)
        if buf.reward is not None and details is not None:
            buf.reward_details = details
        return buf

    def close(self) -> None:
        self.agent.close()
        self.servers.close()


def load_user_function(path: str | None, flag: str) -> Callable | None:
    if not path:
        return None
    from sluiceway.infra.plugins import load_function

    fn = load_function(path, flag)
    if not callable(fn):
        raise UserError(f"{flag} {path}: not a function")
    return fn
