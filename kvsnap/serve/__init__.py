"""``kvsnap serve``'s logic without HTTP: the OpenAI shapes (``protocol``, its refusals in ``errors``),
tool calls in and out (``tools``), API keys and their namespaces (``keys``), the one-at-a-time line
(``turns``) and the request path (``service``).

The HTTP server itself (Starlette and uvicorn) is ``cli/serve.py``. No torch at import.
"""

from kvsnap.serve.keys import ApiKeys, is_loopback, key_namespace, read_keys_file
from kvsnap.serve.protocol import CHAT, COMPLETION, CompletionRequest, ServeError, parse_request
from kvsnap.serve.service import Cancelled, Completion, Service
from kvsnap.serve.tools import ToolAnswer, ToolCall, ToolChoice, ToolStream, parse_answer, template_style
from kvsnap.serve.turns import Ticket, Turns

__all__ = [
    "CHAT",
    "COMPLETION",
    "ApiKeys",
    "Cancelled",
    "Completion",
    "CompletionRequest",
    "ServeError",
    "Service",
    "Ticket",
    "ToolAnswer",
    "ToolCall",
    "ToolChoice",
    "ToolStream",
    "Turns",
    "is_loopback",
    "key_namespace",
    "parse_answer",
    "parse_request",
    "read_keys_file",
    "template_style",
]
