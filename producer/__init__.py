"""layertap's client side: the wire protocol, settings, submitting jobs, reading results
and files. Imports no torch.
"""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

from producer.client import Client
from producer.fileformat import FileFormatError
from producer.reader import cleanup_hidden_states, load_hidden_states
from producer.schema import ChatMessage, ErrorType, Job, Result, Status
from producer.settings import Settings

__all__ = [
    "__version__", "ChatMessage", "Client", "ErrorType", "FileFormatError", "Job", "Result", "Settings", "Status",
    "cleanup_hidden_states", "load_hidden_states",
]
