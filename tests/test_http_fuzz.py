"""Wrong JSON types in the fields the OpenAI endpoints read (hypothesis), against the split system's HTTP
front: no request gets a 500; each is served (200) or refused with a 4xx carrying OpenAI's error object."""
from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from shared.serving.openai.chat import CHAT_FIELDS
from shared.serving.openai.protocol import INFORMATIONAL_FIELDS, SAMPLING_FIELDS
from tests.test_http_api import _wait_pods_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NUM_EXAMPLES = 300
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                       "properties": {"x": {"type": "boolean"}}}}}
# endpoint -> (a body it serves, the paths into it whose values are replaced)
_TOP = (*SAMPLING_FIELDS, *INFORMATIONAL_FIELDS, "model", "stream", "stream_options", "request_id")
ENDPOINTS: dict[str, tuple[dict[str, Any], list[tuple]]] = {
    "/chat/completions": (
        {"model": "tiny", "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}], "tools": [TOOL], "tool_choice": "none",
         "response_format": {"type": "text"}, "max_tokens": 2},
        [(name,) for name in (*_TOP, *CHAT_FIELDS)] + [
            ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "name"),
            ("messages", 1, "tool_calls"), ("messages", 1, "tool_calls", 0), ("messages", 1, "tool_calls", 0,
                                                                               "function", "arguments"),
            ("messages", 2, "tool_call_id"), ("messages", 2, "content"), ("tools", 0), ("tools", 0, "function"),
            ("tools", 0, "function", "parameters"), ("tools", 0, "function", "name"), ("response_format", "type"),
        ]),
    "/completions": ({"model": "tiny", "prompt": "hi", "max_tokens": 2},
                     [(name,) for name in (*_TOP, "prompt", "logprobs", "echo")]),
    "/responses": ({"model": "tiny", "input": [{"role": "user", "content": "hi"}], "text": {"format": {"type": "text"}},
                    "max_output_tokens": 2},
                   [(name,) for name in ("input", "instructions", "max_output_tokens", "tools", "tool_choice",
                                         "text", "stream", "user", "metadata", "temperature", "top_p")]
                   + [("input", 0), ("input", 0, "role"), ("input", 0, "content"), ("text", "format")]),
}
# Any JSON value, sized so a well-typed one cannot ask for long work (numbers small or huge).
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(2**40, 2**70),
                     st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=12))
json_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                              st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=6)
cases = st.sampled_from(sorted(ENDPOINTS)).flatmap(
    lambda path: st.tuples(st.just(path), st.sampled_from(ENDPOINTS[path][1]), json_values))


def _with_value(body: dict[str, Any], where: tuple, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(body)
    node = changed
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    return changed


@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_no_wrong_json_type_gets_a_500(split_cluster, case):
    path, where, value = case
    body = _with_value(ENDPOINTS[path][0], where, value)
    answer = httpx.post(f"{split_cluster.router.http_url}{path}", json=body, timeout=60)
    assert answer.status_code < 500, (where, value, answer.text)
    if answer.status_code != 200:
        error = answer.json()["error"]
        assert isinstance(error["message"], str) and error["type"] in ("invalid_request_error", "rate_limit_error"), \
            (where, value, answer.text)


def test_the_split_system_is_idle_after_the_fuzz_run(split_cluster):
    _wait_pods_idle(split_cluster)
