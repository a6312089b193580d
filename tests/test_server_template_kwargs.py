"""A chat request's ``chat_template_kwargs`` (llama-server's and vLLM's field): its variables
reach the chat template (``enable_thinking`` false closes Qwen3's thinking), the engine's own
variables cannot be set through it, and a request without it renders as before.

Oracle: the prompt's token count in ``usage`` against the template rendered and tokenized here
(``LLM.encode_chat`` with the same variables). The server's own variables
(``--chat-template-kwargs``) apply under a request's."""

from __future__ import annotations

import pytest
from server_support import InProcessServer
from testdata import llama_cpp_path, model_path

from deimos.tokenizer.template import ChatTemplate

MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served():
    s = InProcessServer(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"), n_ctx=256, model_id="m")
    # Qwen3's template (thinking on unless enable_thinking is false) over SmolLM2's vocabulary:
    # its markers are plain text there, which is all the token counts need
    s.llm.template = ChatTemplate(llama_cpp_path("models/templates/Qwen-Qwen3-0.6B.jinja").read_text(),
                                  s.llm.template.bos_token, s.llm.template.eos_token)
    yield s
    s.close()


def _prompt_tokens(served, **fields) -> tuple[int, dict]:
    status, body = served.request("POST", "/v1/chat/completions",
                                  {"model": "m", "messages": MESSAGES, "max_tokens": 1, "temperature": 0,
                                   **fields})
    return status, body


def test_template_variables_reach_the_template(served):
    status, plain = _prompt_tokens(served)
    assert status == 200
    assert plain["usage"]["prompt_tokens"] == len(served.llm.encode_chat(MESSAGES))
    status, off = _prompt_tokens(served, chat_template_kwargs={"enable_thinking": False})
    assert status == 200
    want = served.llm.encode_chat(MESSAGES, enable_thinking=False)
    assert off["usage"]["prompt_tokens"] == len(want) > plain["usage"]["prompt_tokens"]
    status, on = _prompt_tokens(served, chat_template_kwargs={"enable_thinking": True})
    assert status == 200 and on["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("kwargs, words", [
    ({"messages": []}, "'messages' cannot be set"),
    ({"tools": []}, "'tools' cannot be set"),
    ({"add_generation_prompt": False}, "'add_generation_prompt' cannot be set"),
    ({"bos_token": "x"}, "'bos_token' cannot be set"),
    ({"not a name": 1}, "'not a name' cannot be set"),
    ({"__class__": 1}, "'__class__' cannot be set"),
])
def test_the_engines_own_variables_are_refused(served, kwargs, words):
    status, body = _prompt_tokens(served, chat_template_kwargs=kwargs)
    assert status == 400
    assert words in body["error"]["message"] and body["error"]["param"] == "chat_template_kwargs"


def test_the_servers_variables_and_a_requests_own_over_them(served):
    want_off = len(served.llm.encode_chat(MESSAGES, enable_thinking=False))
    served.server.template_kwargs = {"enable_thinking": False}  # --chat-template-kwargs
    try:
        status, body = _prompt_tokens(served)
        assert status == 200 and body["usage"]["prompt_tokens"] == want_off
        status, body = _prompt_tokens(served, chat_template_kwargs={"enable_thinking": True})
        assert status == 200 and body["usage"]["prompt_tokens"] < want_off
    finally:
        served.server.template_kwargs = {}


def test_a_kwargs_field_that_is_no_object_is_a_400(served):
    status, body = _prompt_tokens(served, chat_template_kwargs=["enable_thinking"])
    assert status == 400 and "chat_template_kwargs" in body["error"]["message"] + str(body["error"].get("param"))
