"""The plain endpoints: /v1/models (and one model's card), vLLM's /tokenize and /detokenize, /health and
/metrics."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from shared.serving.openai import protocol as oai
from shared.serving.openai.chat import chat_prompt
from shared.serving.openai.errors import invalid
from shared.serving.openai.state import FrontState
from shared.serving.openai.messages import chat_messages, chat_template_options
from shared.serving.openai.tool_calls import tool_request
from shared.serving.pod.outcomes import InvalidRequest
from shared.serving.text import TextCodec, encode_text


async def models(state: FrontState, request: Request) -> Response:
    """The model list, once the model can serve: clients take a listed model as ready (vLLM's server
    answers nothing before it is)."""
    if (denied := state.check_key(request) or state.check_ready()) is not None:
        return denied
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model(state: FrontState, request: Request) -> Response:
    """OpenAI's retrieve: the card of the model this server serves, else 404."""
    if (denied := state.check_key(request) or state.check_ready()) is not None:
        return denied
    if (unknown := state.unknown_model({"model": request.path_params["model"]})) is not None:
        return unknown
    return JSONResponse(_model_card(state))


def _model_card(state: FrontState) -> dict[str, Any]:
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pdserve"}
    if (max_model_len := state.max_model_len()) is not None:
        card["max_model_len"] = max_model_len
    return card


async def tokenize(state: FrontState, request: Request) -> Response:
    """vLLM's /tokenize: a prompt's token ids (a text, or chat messages rendered with the template)."""
    return await _answer_tokenizer_call(state, request, _tokenized)


async def detokenize(state: FrontState, request: Request) -> Response:
    """vLLM's /detokenize: the text of token ids."""
    return await _answer_tokenizer_call(state, request, _detokenized)


async def _answer_tokenizer_call(state: FrontState, request: Request,
                                 answer: Callable[[FrontState, dict[str, Any], TextCodec], dict]) -> Response:
    """A tokenizer endpoint's answer, computed off the event loop (400 when the input is wrong)."""
    body = await state.request_body(request)
    if isinstance(body, Response):
        return body
    try:
        codec = state.codec()
        if codec is None:
            raise InvalidRequest("this server has no tokenizer: start it with --tokenizer")
        return JSONResponse(await asyncio.to_thread(answer, state, body, codec))
    except InvalidRequest as exc:
        return invalid(exc)


def _tokenized(state: FrontState, body: dict[str, Any], codec: TextCodec) -> dict[str, Any]:
    if "messages" in body:
        oai.check_fields(body, ("messages", "chat_template_kwargs", "add_generation_prompt",
                                "continue_final_message", "tools", "return_token_strs"))
        tools = tool_request({**body, "tool_choice": "none"}, None) if body.get("tools") is not None else None
        token_ids = chat_prompt(state, chat_messages(body), chat_template_options(body), tools)
    else:
        oai.check_fields(body, ("prompt", "add_special_tokens", "return_token_strs"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' (a string) or 'messages' is required")
        add_special_tokens = body.get("add_special_tokens", True)
        token_ids = encode_text(codec.tokenizer, prompt,
                                add_special_tokens=oai.boolean("add_special_tokens", add_special_tokens))
    answer = {"count": len(token_ids), "max_model_len": state.max_model_len(), "tokens": token_ids}
    if body.get("return_token_strs") is not None and oai.boolean("return_token_strs", body["return_token_strs"]):
        answer["token_strs"] = codec.token_texts(token_ids)
    return answer


def _detokenized(state: FrontState, body: dict[str, Any], codec: TextCodec) -> dict[str, Any]:
    oai.check_fields(body, ("tokens",))
    token_ids = list(oai.token_ids("tokens", body.get("tokens")))
    if (vocab_size := codec.vocab_size) and any(token >= vocab_size for token in token_ids):
        raise InvalidRequest(f"tokens must be ids below the vocabulary size {vocab_size}")
    return {"prompt": codec.decode(token_ids, skip_special_tokens=False)}  # as vLLM: special tokens kept


async def health(state: FrontState, request: Request) -> Response:
    return Response(status_code=200 if state.is_ready() else 503)


async def metrics(state: FrontState, request: Request) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
