"""A small multi-step game written against OpenEnv 0.10's API (served by its `create_app`; imported only by the
interpreter that has openenv): guess a number from 1 to 8 in at most three tries, told "higher" or "lower" after
each wrong one. Reward 1.0 for the right guess, else 0.0 each step.

For the failure tests, files named by environment variables make the server misbehave once:
GUESS_DIE_ONCE=path: the first step of the server process that creates `path` ends the process (os._exit);
GUESS_HANG_ONCE=path: likewise, that step never answers; GUESS_HUGE_ONCE=path: likewise, that step's reward
is 1e300 (beyond float32); GUESS_RAISE_ONCE=path: that step raises. Checked in this order, each only once the
one before has happened.
GUESS_KILLME_ONCE=path: the first step writes the server's pid to `path` and waits (for a test to SIGKILL it).
"""

import os
import random
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """Guess the secret number."""

    number: int = Field(description="your guess, from 1 to 8")


class GuessObservation(Observation):
    message: str = Field(description="what the game says")


class GuessState(State):
    secret: int = 0
    tries_left: int = 3


def _once(var: str) -> bool:
    path = os.environ.get(var)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class GuessGame(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = GuessState()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        secret = random.Random(seed).randint(1, 8)
        self._state = GuessState(episode_id=episode_id, step_count=0, secret=secret, tries_left=3)
        return GuessObservation(message="I picked a number from 1 to 8. You have 3 tries: guess it.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if _once("GUESS_KILLME_ONCE"):
            with open(os.environ["GUESS_KILLME_ONCE"] + ".pid", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        if _once("GUESS_DIE_ONCE"):
            os._exit(3)
        if _once("GUESS_HANG_ONCE"):
            time.sleep(3600)
        s = self._state
        s.step_count += 1
        s.tries_left -= 1
        huge = _once("GUESS_HUGE_ONCE")
        if not huge and _once("GUESS_RAISE_ONCE"):
            raise RuntimeError("the game broke")
        if action.number == s.secret:
            return GuessObservation(message="Right!", done=True, reward=1e300 if huge else 1.0)
        hint = "higher" if action.number < s.secret else "lower"
        if s.tries_left == 0:
            return GuessObservation(message=f"No: {hint}. Out of tries.", done=True, reward=1e300 if huge else 0.0)
        return GuessObservation(message=f"No: {hint}. {s.tries_left} tries left.", reward=1e300 if huge else 0.0)

    @property
    def state(self) -> GuessState:
        return self._state


class SoloGuessGame(GuessGame):
    """The same game, not declared safe for concurrent sessions: openenv serves it one session per server."""

    SUPPORTS_CONCURRENT_SESSIONS = False


class UnionGuessGame(Environment):
    """The game as OpenEnv's echo_env declares itself: a plain Environment whose step takes a Union of its own model
    and the MCP ones."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._game = GuessGame()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        return self._game.reset(seed=seed, episode_id=episode_id)

    def step(
        self, action: GuessAction | CallToolAction, timeout_s=None, **kwargs
    ) -> GuessObservation | CallToolObservation:
        return self._game.step(action)

    @property
    def state(self) -> GuessState:
        return self._game.state


# An app as `openenv init` writes one (server/app.py): made by create_app, one session at a time.
app = create_app(GuessGame, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=1)
