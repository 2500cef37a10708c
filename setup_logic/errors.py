"""Errors a person can cause while checking the PC, choosing or installing a model.

Each one's str() is a single sentence that says what is wrong and what to do; the MCP tools show it as is.
"""


class SetupError(Exception):
    """Something the user can fix: the message says what is wrong and what to do."""


class UnknownModelError(SetupError):
    """A model id that is not in the catalog."""


class NotEnoughDiskError(SetupError):
    """The data folder's drive has too little free space for the download."""


class DownloadError(SetupError):
    """A download failed (network, server, full disk); partial bytes are kept for the resume."""


class VerificationError(SetupError):
    """A downloaded file has the wrong size or sha256; it was removed and nothing was registered."""
