"""The HTTP front's settings (flags of the router and the colocated server) and the paths it serves."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.serving.openai.reasoning import ReasoningParser
from shared.serving.openai.tool_calls import ToolCallParser
from shared.serving.server.settings import setting

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"


def _none_if_empty(value: str | None) -> str | None:
    return value or None


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP front's settings (flags of the router and the colocated server)."""

    http_port: int | None = field(default=None, metadata=setting(
        "OpenAI-compatible HTTP port (0 picks one; off when unset)"
    ))
    served_model_name: str | None = field(default=None, metadata=setting(
        "the model name the HTTP API answers to (default: the model or tokenizer name)", parse=_none_if_empty
    ))
    http_max_body_mib: int = field(default=16, metadata=setting(
        "largest request body the HTTP API reads, in MiB (a larger one gets 413 before it is parsed)"
    ))
    tool_call_parser: ToolCallParser | None = field(default=None, metadata=setting(
        'the format the model writes tool calls in, which chat\'s tool_choice "auto" reads them by (off when '
        'unset: "auto" is refused; named and "required" choices work without it)'
    ))
    reasoning_parser: ReasoningParser | None = field(default=None, metadata=setting(
        "read a reasoning model's <think>...</think> apart from its answer, as chat's reasoning (off when unset)"
    ))
    # Browsers may call the API from pages of these origins (CORS). The API's credential is a bearer token,
    # never a cookie, so "*" (vLLM's default) lets no page act with a user's ambient credentials.
    http_allowed_origins: str = field(default="*", metadata=setting(
        "comma-separated origins whose web pages may call the HTTP API (CORS; empty: none)"
    ))

    def __post_init__(self) -> None:
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_max_body_mib < 1:
            raise ValueError(f"http_max_body_mib must be at least 1, got {self.http_max_body_mib}")

    @property
    def max_body_bytes(self) -> int:
        return self.http_max_body_mib * 2**20

    @property
    def allowed_origins(self) -> list[str]:
        return [origin.strip() for origin in self.http_allowed_origins.split(",") if origin.strip()]
