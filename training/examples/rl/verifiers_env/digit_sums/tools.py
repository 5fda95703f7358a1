import verifiers.v1 as vf


class DigitSumsToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two whole numbers and return their sum."""
        return str(a + b)


if __name__ == "__main__":
    DigitSumsToolset.run()
