"""The scorer registry: --rm-type names a built-in scorer, --custom-rm-path the user's function."""

from __future__ import annotations

from collections.abc import Callable

from sluiceway.infra.errors import UserError
from sluiceway.tasks.environments import env_reward
from sluiceway.tasks.reward.code_exec import code_reward
from sluiceway.tasks.reward.math_answer import exact_reward, math_reward
from sluiceway.tasks.reward.verifiers import VERIFIERS

# A scorer takes (response_text, label, sample) and returns a float or (float, details dict).
Scorer = Callable[..., float | tuple[float, dict]]

# math, exact, regex, f1, choice, format, math+format: see verifiers/ (every one returns (reward in [0, 1], details)).
BUILTIN: dict[str, Callable[[str, str], tuple[float, dict]]] = {
    **VERIFIERS,
    "math": math_reward,
    "exact": exact_reward,
    "code": code_reward,  # runs the response's code in the sandbox (reward/sandbox.py) against the label's tests
}


def deepscaler_reward(response: str, label: str) -> tuple[float, dict]:
    """slime's --rm-type deepscaler: the answer after the last </think> (or ###Response) graded as `math`;
    0 when the response has neither marker (slime's rm_hub/deepscaler.py)."""
    for marker in ("</think>", "###Response"):
        if marker in response:
            solution = response.split(marker)[-1] if marker == "</think>" else response.split(marker)[1]
            return math_reward(solution, label)
    return 0.0, {"reason": "no </think> or ###Response"}


BUILTIN["deepscaler"] = deepscaler_reward
# Scorers that need the whole sample: `env` routes to the verifier of the environment that made the prompt.
BUILTIN_WITH_SAMPLE: dict[str, Callable[[str, str, dict], tuple[float, dict]]] = {"env": env_reward}
RM_TYPES = [*BUILTIN, *BUILTIN_WITH_SAMPLE, "remote"]


def load_custom(path: str) -> Scorer:
    from sluiceway.tasks.rollout.slime_plugins.convention import load_plugin  # 'module:fn', 'file.py:fn', 'module.fn'

    return load_plugin(path, "--custom-rm-path")


def get_scorer(rm_type: str, custom_rm_path: str | None) -> Callable:
    """A per-sample scorer; its result (float, (float, details) or dict) is interpreted by reward/score.py."""
    if custom_rm_path:
        return load_custom(custom_rm_path)  # (response, label, sample) or, with --group-rm, whole groups
    if rm_type in BUILTIN_WITH_SAMPLE:
        return BUILTIN_WITH_SAMPLE[rm_type]
    if rm_type not in BUILTIN:
        raise UserError(f"--rm-type {rm_type}: unknown (built-in: {', '.join(RM_TYPES)}; or use --custom-rm-path)")
    builtin = BUILTIN[rm_type]
    return lambda response, label, sample: builtin(response, label)


def remote_group_scorer(url: str, api_key_env: str | None, timeout_s: float) -> Callable:
    """--rm-type remote: one HTTP batch per group to a reward-model server (protocol: reward/remote.py)."""
    from sluiceway.tasks.reward.remote import RemoteRewardModel

    rm = RemoteRewardModel(url, timeout_s=timeout_s, api_key_env=api_key_env)

    def score_group(responses: list[str], labels: list, samples: list[dict]) -> list[tuple[float, dict]]:
        items = [
            {"prompt": s.get("prompt"), "response": r, "label": lab, "metadata": s.get("metadata")}
            for r, lab, s in zip(responses, labels, samples)
        ]
        out = []
        for reward, details in rm.score(items):
            if reward is None:  # the server was down, slow or failing after retries: recorded, scored 0
                raise RuntimeError(details.get("error", "remote reward model gave no reward"))
            out.append((reward, details))
        return out

    return score_group
