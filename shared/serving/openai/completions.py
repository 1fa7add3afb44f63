"""/v1/completions: a prompt, token ids or a batch of either, each with its n completions; echo returns
the prompt (and its logprobs) before the completion."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from shared.serving.generation import GenerateInput
from shared.serving.openai import protocol as oai
from shared.serving.openai.choices import Echo, ParsedRequest
from shared.serving.openai.serve import plain_answer, serve
from shared.serving.openai.state import FrontState
from shared.serving.pod.outcomes import InvalidRequest


async def completions(state: FrontState, request: Request) -> Response:
    return await serve(state, request, is_chat=False, parse=completion_inputs, answer=plain_answer)


def completion_inputs(state: FrontState, body: dict[str, Any]) -> tuple[list[GenerateInput], ParsedRequest]:
    """One generation input per prompt and what the answer needs to know of the request."""
    oai.check_fields(body, ("prompt", "logprobs", "echo"))
    prompts = oai.completion_prompts(body)
    echo_options = oai.completion_echo(body)
    echoes: tuple[Echo, ...] = ()
    if echo_options is not None:
        echoed = [_echoed(state, prompt, echo_options) for prompt in prompts]
        prompts, echoes = [ids for ids, _ in echoed], tuple(echo for _, echo in echoed)
    options = oai.stream_options_from_openai(body)
    params = oai.sampling_params_from_openai(body, echo=echo_options)
    parsed = ParsedRequest(options, wants_logprobs=params.logprobs is not None, n=params.n, echoes=echoes)
    return oai.generate_inputs(body, prompts, params), parsed


def _echoed(state: FrontState, prompt: str | list[int], options: oai.EchoOptions) -> tuple[list[int], Echo]:
    """The prompt's token ids and its echo: the text as given (or as its token ids decode)."""
    codec = state.codec()
    if codec is None:
        raise InvalidRequest("echo needs a tokenizer: start the server with --tokenizer")
    token_ids = codec.encode(prompt) if isinstance(prompt, str) else prompt
    if not token_ids:
        raise InvalidRequest("prompt text encodes to no tokens")
    text = prompt if isinstance(prompt, str) else codec.decode(prompt)
    return token_ids, Echo(text, token_ids[0], options.without_output)
