import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.SharedToolsetConfig]):
    """The environment's one tool, run by verifiers as an MCP server (`python -m sw_add_v1.tools`), one for the
    taskset (`Taskset.toolsets`): started once, not per episode."""

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers and return their sum."""
        return str(int(a) + int(b))


if __name__ == "__main__":
    AddToolset.run()
