import verifiers.v1 as vf


class ArithToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "arith"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two whole numbers and return the sum."""
        return str(a + b)


if __name__ == "__main__":
    ArithToolset.run()
