"""/v1/chat/completions: messages rendered with the model's chat template, tools (a forced call's
constraint, calls read from the text), and a reasoning model's thinking read apart."""
from __future__ import annotations

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from shared.serving.generation import GenerateInput
from shared.serving.openai import protocol as oai
from shared.serving.openai.choices import ParsedRequest
from shared.serving.openai.reasoning import prompt_opens_thinking
from shared.serving.openai.serve import plain_answer, serve
from shared.serving.openai.state import FrontState
from shared.serving.openai.messages import ChatTemplateOptions, chat_messages, chat_template_options
from shared.serving.openai.tool_calls import ToolRequest, tool_request
from shared.serving.chat_template import ChatTemplateError
from shared.serving.pod.outcomes import InvalidRequest

# Enough of a chat prompt's end to see whether its template opened the model's thinking.
_PROMPT_TAIL_TOKENS = 16
CHAT_FIELDS = ("messages", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "logprobs",
               "top_logprobs", "tools", "tool_choice", "reasoning_effort")


async def chat_completions(state: FrontState, request: Request) -> Response:
    return await serve(state, request, is_chat=True, parse=chat_inputs, answer=plain_answer)


def chat_inputs(state: FrontState, body: dict[str, Any]) -> tuple[list[GenerateInput], ParsedRequest]:
    """The chat request's generation input and what the answer needs to know of the request."""
    oai.check_fields(body, CHAT_FIELDS)
    tools = tool_request(body, state.config.tool_call_parser)
    prompt = chat_prompt(state, chat_messages(body), chat_template_options(body), tools)
    opens_thinking = None
    if state.config.reasoning_parser is not None:
        tail = state.codec().decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        opens_thinking = prompt_opens_thinking(tail)
    options = oai.stream_options_from_openai(body)
    params = oai.sampling_params_from_openai(
        body, is_chat=True, default_max_tokens=_rest_of_context(state, len(prompt)),
        tool_constraint=tools.constraint() if tools is not None else None,
        default_constraint=tools.auto_constraint(opens_thinking) if tools is not None else None)
    parsed = ParsedRequest(options, wants_logprobs=params.logprobs is not None, n=params.n, tools=tools,
                           opens_thinking=opens_thinking)
    return oai.generate_inputs(body, [prompt], params), parsed


def chat_prompt(state: FrontState, messages: list[dict], options: ChatTemplateOptions,
                tools: ToolRequest | None) -> list[int]:
    """The token ids of the messages rendered with the model's chat template."""
    codec = state.codec()
    if codec is None:
        raise InvalidRequest("chat needs a tokenizer with a chat template: start the server with --tokenizer")
    try:
        return codec.encode_chat(messages, **dataclasses.asdict(options),
                                 tools=list(tools.tools) if tools is not None else None)
    except ChatTemplateError as exc:  # no template, or the template refused the messages
        raise InvalidRequest(f"chat template: {exc}") from None


def _rest_of_context(state: FrontState, num_prompt_tokens: int) -> int:
    """Chat's max_tokens when the request names none and the checkpoint's generation_config.json no
    max_new_tokens, as vLLM does: the rest of the model's length (at least 1, so a prompt that fills
    it is refused for its length). It travels as fallback_max_tokens; the pod fills the rest."""
    max_model_len = state.max_model_len()
    if max_model_len is None:  # no pod has reported yet: the request will not run anyway
        return oai.COMPLETIONS_DEFAULT_MAX_TOKENS
    return max(1, max_model_len - num_prompt_tokens)
