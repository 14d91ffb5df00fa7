"""An MCP environment written against OpenEnv 0.10's MCPEnvironment (its tools are FastMCP functions, called with
list_tools / call_tool actions): a counter with one tool, `add`. Imported only by the interpreter with openenv."""

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State
from pydantic import Field


class CounterObservation(Observation):
    message: str = Field(default="", description="what the environment says")


class CounterEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("counter")
        self.total = 0

        @mcp.tool()
        def add(n: int) -> str:
            """Add n to the counter and say the total."""
            self.total += n
            return f"total {self.total}"

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> CounterObservation:
        self.total = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return CounterObservation(message="Bring the counter to 5 with the add tool.")

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return CounterObservation(message=f"unknown action {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state
