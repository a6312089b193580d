"""``deimos serve`` as a client sees it: a real server process on loopback (the default model,
CPU, context 512, an API key) driven by the official ``openai`` client and by plain HTTP.

Oracles: the engine in this process (``LLM``: the server must answer what the engine
generates), the server's own answer to the same request without the feature under test
(stop strings cut the plain text; a stream concatenates to the non-streamed answer), JSON
Schema validation (jsonschema) of constrained output and tool arguments, the log-softmax
identity (greedy picks the most likely token), and the server's /metrics counters.
"""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import openai
import pytest

from deimos.engine import LLM
from server_support import ServerProcess
from testdata import model_path

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
KEY = "test-key-5f1e"
N_CTX = 512
GREEDY = {"temperature": 0}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(model_path(SMOL), "-c", str(N_CTX), "--api-key", KEY,
                      log_dir=tmp_path_factory.mktemp("serve"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model_path(SMOL), n_ctx=N_CTX)


AUTH = {"Authorization": f"Bearer {KEY}"}


def metric(server: ServerProcess, name: str) -> float:
    status, text = server.request("GET", "/metrics", headers=AUTH)
    assert status == 200
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == name:
            return float(value)
    raise AssertionError(f"{name} not in /metrics:\n{text}")


# ---- basics -----------------------------------------------------------------------------

def test_models_health_and_api_key(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert server.request("GET", "/health")[0] == 200  # no key needed
    status, body = server.request("GET", "/v1/models")
    assert status == 401 and "API key" in body["error"]["message"]
    status, body = server.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])


def test_completion_matches_engine_and_stop_strings(client, llm):
    prompt = "1, 2, 3, 4, 5,"
    want = llm.generate(prompt, max_tokens=5, raw=True, temperature=0)
    full = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=5, **GREEDY)
    assert full.choices[0].text == want.text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == want.prompt_tokens
    assert full.usage.completion_tokens == 5
    # a stop string of three tokens ("," " " "7"): "," and " " are held back until "7"
    # shows they are the stop
    stop = ", 7"
    assert stop in want.text, want.text
    cut = want.text[: want.text.index(stop)]
    out = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=5, stop=[stop],
                                    **GREEDY)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=5, stop=stop, stream=True, **GREEDY)
        if c.choices]
    assert "".join(pieces) == cut
    assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))


def test_chat_plain_stream_and_prefix_reuse(server, client, llm):
    messages = [{"role": "user", "content": "Name a color."}]
    want = llm.chat(messages, max_tokens=4, temperature=0)
    a = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4, **GREEDY)
    assert a.choices[0].message.content == want.text
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason == want.finish_reason
    assert a.usage.prompt_tokens == want.prompt_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [a.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == a.usage.completion_tokens
    # the same prompt again: every full KV block of it but the last prompt token's comes
    # from the prefix cache
    bs = int(metric(server, "deimos_kv_block_size"))
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // bs * bs

    # a second turn prefills only what is new; the engine in this process agrees on how much
    turn2 = messages + [{"role": "assistant", "content": text},
                        {"role": "user", "content": "Another one."}]
    b = client.chat.completions.create(model=MODEL_ID, messages=turn2, max_tokens=2, **GREEDY)
    ref = llm.chat(turn2, max_tokens=2, temperature=0)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached == ref.cached_tokens and cached >= a.usage.prompt_tokens // bs * bs
    assert b.choices[0].message.content == ref.text


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Count: 1, 2, 3"}], max_tokens=3,
        logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 3
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(tops[0])
        assert bytes(t.bytes).decode() == t.token
        assert sum(2.718281828 ** x for x in tops) <= 1 + 1e-5

    c = client.completions.create(model=MODEL_ID, prompt="The sky is", max_tokens=3, logprobs=2,
                                  **GREEDY)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.tokens) == 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and value == pytest.approx(max(top.values())) and top[tok] == value


def test_json_schema_answer_validates(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Is water wet? Answer in JSON."}],
        max_tokens=24, response_format={"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": schema}},
        **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER], max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'},
    ]
    r2 = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=[WEATHER],
                                        max_tokens=4, **GREEDY)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the first turn (with the tool list) was not prefilled again
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1


def test_tool_calls_per_choice(client):
    """n = 2 sampled choices, each its own forced call (its own constraint state)."""
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Weather in Rome and Oslo?"}],
        tools=[WEATHER], max_tokens=40, n=2, seed=4, temperature=0.7,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])


# ---- serving many clients -----------------------------------------------------------------

def test_concurrent_requests_are_all_answered(client):
    prompts = ["Red, green,", "Monday, Tuesday,", "one, two,"]
    solo = [client.completions.create(model=MODEL_ID, prompt=p, max_tokens=2, **GREEDY)
            .choices[0].text for p in prompts]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = client.completions.create(model=MODEL_ID, prompt=prompts[i], max_tokens=2,
                                           **GREEDY).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert [got.get(i) for i in range(len(prompts))] == solo


def test_disconnect_frees_the_engine(server, client):
    before = metric(server, "deimos_generated_tokens_total")
    conn = server.connect()
    body = {"model": MODEL_ID, "prompt": "Write a long story.", "max_tokens": 400,
            "stream": True, **GREEDY}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()  # the first token's chunk has arrived: generation is running
    assert first.startswith(b"data: ")
    conn.sock.close()
    conn.close()
    # a new request is answered, and the abandoned one stopped long before its 400 tokens
    r = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=1, **GREEDY)
    assert r.usage.completion_tokens == 1
    deadline = time.monotonic() + 60
    while metric(server, "deimos_client_disconnects_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "deimos_client_disconnects_total") >= 1
    assert metric(server, "deimos_generated_tokens_total") - before < 100


# ---- bad input ----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, status, param, words", [
    (CHAT, {"model": MODEL_ID}, 400, "messages", "required"),
    (CHAT, {"model": MODEL_ID, "messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "temperature": "hot"}, 400, "temperature", "number"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "temperature": 5}, 400, "temperature", "2"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "top_p": 1.5}, 400, "top_p", "1"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "max_tokens": 0}, 400, "max_tokens", "1"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "max_tokens": 5000}, 400, "max_tokens",
     "context"),
    (CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "messages", "context"),
    (CHAT, {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role", "user"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "n": 17}, 400, "n", "16"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     400, "tools", "JSON Schema"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "tool_choice": {
        "type": "function", "function": {"name": "missing"}}}, 400, "tool_choice", "missing"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}}, 400,
     "response_format.json_schema.schema", "JSON Schema"),
    (CHAT, {"model": MODEL_ID, "messages": MSG, "logit_bias": {"999999": 1}}, 400,
     "logit_bias", "token id"),
    ("/v1/completions", {"model": MODEL_ID, "prompt": [1, 2, 10**9]}, 400, "prompt",
     "vocabulary"),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "hi", "stop": [""]}, 400, "stop",
     "non-empty"),
], ids=["no-messages", "empty-messages", "wrong-type", "temperature-range",
        "top-p-range", "max-tokens-zero", "max-tokens-past-context", "prompt-too-long",
        "bad-role", "n", "tool-schema", "tool-choice", "response-schema", "logit-bias",
        "token-id", "empty-stop"])
def test_bad_input_gets_a_4xx_that_names_the_problem(server, path, body, status, param, words):
    got, resp = server.request("POST", path, body, headers=AUTH)
    assert got == status, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err


def test_any_model_id_is_the_served_model(server, client):
    """As llama-server: one model is served, whatever the request names."""
    r = client.chat.completions.create(model="gpt-17", messages=MSG, max_tokens=1, **GREEDY)
    assert r.model == MODEL_ID and r.usage.completion_tokens == 1
    assert client.models.retrieve("gpt-17").id == MODEL_ID


def test_malformed_requests_and_unknown_routes(server, client):
    for raw in (b"{not json", b"[1, 2]", b"", b"\xff\xfe"):
        status, body = server.request("POST", CHAT, raw=raw, headers=AUTH)
        assert status == 400 and body["error"]["message"], (raw, body)
    assert server.request("GET", "/v2/nothing", headers=AUTH)[0] == 404
    assert server.request("GET", CHAT, headers=AUTH)[0] == 405
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL_ID, prompt="word " * 600, max_tokens=1)
    assert server.request("GET", "/health")[0] == 200  # still serving


# ---- observability ------------------------------------------------------------------------

def test_metrics_and_request_log(server, client):
    for _ in range(2):  # the second reuses the first's prompt (whole blocks of it: > 16 tokens)
        client.completions.create(model=MODEL_ID, prompt="Metrics, please. " * 12, max_tokens=1)
    server.request("GET", "/v1/nothing", headers=AUTH)
    server.request("POST", CHAT, {"model": MODEL_ID}, headers=AUTH)
    status, text = server.request("GET", "/metrics", headers=AUTH)
    assert status == 200
    for name in ("deimos_requests_total", "deimos_prompt_tokens_total",
                 "deimos_cached_tokens_total", "deimos_generated_tokens_total",
                 "deimos_time_to_first_token_seconds_bucket", "deimos_decode_tokens_per_second",
                 "deimos_prefill_tokens_per_second", "deimos_running_sequences",
                 "deimos_kv_blocks_used", "deimos_prefix_cache_hit_rate",
                 "deimos_preemptions_total"):
        assert name in text
    assert metric(server, 'deimos_memory_bytes{kind="model_weights"}') > 100e6
    assert metric(server, 'deimos_memory_bytes{kind="kv_cache"}') > 0
    assert metric(server, 'deimos_memory_bytes{kind="process_rss"}') > 100e6
    assert metric(server, "deimos_cached_tokens_total") > 0
    assert metric(server, 'deimos_requests_total{route="/v1/chat/completions",status="400"}') >= 1
    logs = [json.loads(line) for line in server.log_lines() if line.startswith("{")]
    done = [x for x in logs if x.get("finish_reason")]
    assert done and all({"prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms",
                         "status", "path"} <= x.keys() for x in done)
    assert any(x["status"] == 404 for x in logs)
