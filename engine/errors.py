"""The one exception type the engine raises for anything a person can cause or fix."""


class EngineError(Exception):
    """A problem with a model file, a setting or a request, explained in a plain sentence.

    The message always says what is wrong and what to do about it, so callers (the MCP tools, the CLI)
    can show it to a person as it is.
    """


class Cancelled(EngineError):
    """The caller asked to stop (through `should_cancel`) before the work finished."""


class DamagedModel(EngineError):
    """The model computed NaN or infinity: its weights are damaged (a file changed on disk, a bad download)."""
