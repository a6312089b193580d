"""``deimos serve`` decoding many requests together: ``n`` choices, ``ignore_eos``, prefix-cache
hits in usage, the engine's gauges on /metrics, 32 clients at once, a cancelled stream, a
full queue, any model id.

Most tests talk HTTP to the real app over a real engine in this process (``InProcessServer``:
the tiny random-weight llama with SmolLM2's vocabulary, on the CPU), so that they can look at
the engine's KV blocks; the CLI's flags (--alias, --max-seqs, --max-queue) are tested through
a real ``deimos serve`` process.

Oracles: the same server's answer to each request alone (choice i of a request seeded s equals
the one-choice request seeded s + i; an answer among 32 concurrent ones equals the answer
alone), a stream concatenating to the non-streamed answer, the token counts asked for, the
prefix cache's block arithmetic, the block manager's own counts and invariant check.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest
import torch
from server_support import InProcessServer, ServerProcess, metric_values, sse_events
from testdata import model_path

from deimos.synth import write_model

DONOR = "SmolLM2-135M-Instruct.Q4_1.gguf"  # vocabulary and chat template of the tiny model
N_CTX = 1024
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
WIDE = {"temperature": 1.5, "top_k": 0, "min_p": 0.0}  # seeds lead to different answers

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("batching") / "tiny.gguf"
    return write_model(path, "llama", "llama-tiny", "Q8_0", model_path(DONOR), seed=5)


@pytest.fixture(scope="module")
def served(tiny):
    s = InProcessServer(tiny, n_ctx=N_CTX, model_id="tiny")
    yield s
    s.close()


def post(served, path: str, body: dict) -> dict:
    status, answer = served.request("POST", path, body)
    assert status == 200, answer
    return answer


def body_for(path: str, text: str, **fields) -> dict:
    if path == CHAT:
        return {"model": "tiny", "messages": [{"role": "user", "content": text}], **fields}
    return {"model": "tiny", "prompt": text, **fields}


def text_of(path: str, choice: dict) -> str:
    return choice["message"]["content"] if path == CHAT else choice["text"]


def idle(served, timeout: float = 60) -> None:
    """Wait until no request is active, the engine holds no block and /metrics has the
    engine's stats after its last step (a client has its answer a little before the worker
    is done with the step that produced it)."""
    deadline = time.monotonic() + timeout
    engine = served.llm.engine
    while (served.metrics.snapshot()["active"] or engine.blocks.n_used
           or served.metrics.engine != engine.stats()):
        assert time.monotonic() < deadline, (served.metrics.snapshot()["active"],
                                             engine.blocks.n_used)
        time.sleep(0.02)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


# ---- n choices ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_n_choices_are_the_seeded_single_answers(served, path):
    body = body_for(path, "Tell me about the sea.", max_tokens=6, seed=11, n=3, **WIDE)
    r = post(served, path, body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    texts = [text_of(path, c) for c in r["choices"]]
    singles = [post(served, path, {**body, "n": 1, "seed": 11 + i}) for i in range(3)]
    assert texts == [text_of(path, s["choices"][0]) for s in singles]
    assert len(set(texts)) > 1, texts  # the seeds differ
    assert [c["finish_reason"] for c in r["choices"]] == [
        s["choices"][0]["finish_reason"] for s in singles]
    u = r["usage"]
    assert u["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
    again = post(served, path, body)  # reproducible
    assert [text_of(path, c) for c in again["choices"]] == texts


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_n_choices_streamed_concatenate_to_the_whole_answers(served, path):
    body = body_for(path, "Name three rivers.", max_tokens=5, seed=3, n=3, **WIDE)
    whole = post(served, path, body)
    status, raw = served.request("POST", path, {**body, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert last["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [last["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= whole["usage"][
        "prompt_tokens_details"]["cached_tokens"]  # the same prompt again: more of it cached
    texts, finishes, ends = ["", "", ""], [[], [], []], {}
    for k, e in enumerate(chunks):
        assert e["id"] == chunks[0]["id"] and e["model"] == "tiny"
        (c,) = e["choices"]
        i = c["index"]
        assert i not in ends, "a chunk after its choice's finish"
        texts[i] += (c["delta"].get("content") or "") if path == CHAT else c["text"]
        if c["finish_reason"] is not None:
            finishes[i].append(c["finish_reason"])
            ends[i] = k
    assert texts == [text_of(path, c) for c in whole["choices"]]
    assert finishes == [[c["finish_reason"]] for c in whole["choices"]]
    if path == CHAT:  # each choice opens with its role
        assert [e["choices"][0]["delta"] for e in chunks[:3]] == [
            {"role": "assistant", "content": ""}] * 3
        assert [e["choices"][0]["index"] for e in chunks[:3]] == [0, 1, 2]


def test_n_choices_logprobs_are_per_choice(served):
    body = body_for(CHAT, "Count to three.", max_tokens=4, seed=8, n=2, logprobs=True,
                    top_logprobs=2, **WIDE)
    r = post(served, CHAT, body)
    for c in r["choices"]:
        content = c["logprobs"]["content"]
        assert "".join(t["token"] for t in content) == c["message"]["content"]
        assert len(content) == 4
    assert r["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("n", [0, 17, 1.5, "2"])
def test_n_out_of_range_is_a_400_naming_n(served, n):
    status, r = served.request("POST", COMPLETIONS, body_for(COMPLETIONS, "hi", n=n))
    assert status == 400 and r["error"]["param"] == "n", r


# ---- ignore_eos ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_ignore_eos_runs_to_max_tokens(served, path):
    """Every end-of-generation token biased up so that the model picks one at once: the
    answer stops there, unless ignore_eos."""
    bias = {str(t): 100 for t in served.llm.stop_ids}
    body = body_for(path, "Hello", max_tokens=9, temperature=0, logit_bias=bias)
    stopped = post(served, path, body)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] <= 1
    ran = post(served, path, {**body, "ignore_eos": True})
    assert ran["choices"][0]["finish_reason"] == "length"
    assert ran["usage"]["completion_tokens"] == 9


def test_ignore_eos_is_refused_with_json_output(served):
    status, r = served.request("POST", CHAT, body_for(
        CHAT, "JSON", max_tokens=4, ignore_eos=True, response_format={"type": "json_object"}))
    assert status == 400 and r["error"]["param"] == "ignore_eos", r


def test_n_predict_is_max_tokens(served):
    r = post(served, COMPLETIONS, body_for(COMPLETIONS, "Once", n_predict=3, ignore_eos=True,
                                           temperature=0))
    assert r["usage"]["completion_tokens"] == 3
    both = post(served, COMPLETIONS, body_for(COMPLETIONS, "Once", n_predict=3, max_tokens=2,
                                              ignore_eos=True, temperature=0))
    assert both["usage"]["completion_tokens"] == 2  # max_tokens wins


# ---- the prefix cache in usage and /metrics -------------------------------------------------

def test_cached_tokens_of_a_shared_prefix_and_the_engine_gauges(served):
    idle(served)
    bs = served.llm.engine.cfg.block_size
    before = metric_values(served.request("GET", "/metrics")[1])
    shared = random_ids(random.Random(5), 150)  # > 64 tokens: full blocks of any block size
    first = post(served, COMPLETIONS, {"model": "tiny", "prompt": shared + [7, 8, 9],
                                       "max_tokens": 1})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, raw = served.request("POST", COMPLETIONS, {
        "model": "tiny", "prompt": shared + [10, 11], "max_tokens": 1, "stream": True,
        "stream_options": {"include_usage": True}})
    usage = sse_events(raw)[-2]["usage"]
    # every full block of the shared part is found; the first differing token ends the match
    assert usage["prompt_tokens_details"]["cached_tokens"] == 150 // bs * bs
    assert usage["prompt_tokens"] == 152
    idle(served)
    after = metric_values(served.request("GET", "/metrics")[1])
    blocks = served.llm.engine.blocks
    assert after["deimos_kv_block_size"] == bs
    assert (after["deimos_running_sequences"], after["deimos_waiting_sequences"]) == (0, 0)
    assert after["deimos_kv_blocks_used"] == 0
    assert after["deimos_kv_blocks_free"] == blocks.usable
    assert after["deimos_kv_blocks_cached"] == blocks.n_cached > 0
    hits = after["deimos_prefix_cache_hit_tokens_total"]
    queries = after["deimos_prefix_cache_query_tokens_total"]
    assert hits - before["deimos_prefix_cache_hit_tokens_total"] == 150 // bs * bs
    assert queries - before["deimos_prefix_cache_query_tokens_total"] == 153 + 152
    assert after["deimos_prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    assert after["deimos_preemptions_total"] == 0
    assert after["deimos_active_requests"] == 0


# ---- many at once, cancellation, faults ---------------------------------------------------

def test_32_concurrent_requests_of_random_lengths(served):
    """Each answer among 32 at once (streamed or not, prompts of 3..200 tokens, 1..24 tokens
    out) is the answer the same request gets alone; afterwards every KV block is free."""
    rng = random.Random(32)
    cases = [{"model": "tiny", "prompt": random_ids(rng, rng.randint(3, 200)),
              "max_tokens": rng.randint(1, 24), "temperature": 0, "ignore_eos": True,
              "stream": rng.random() < 0.5} for _ in range(32)]
    idle(served)
    got: dict[int, tuple[int, str, dict | None]] = {}
    running: list[float] = []

    def ask(i: int) -> None:
        status, answer = served.request("POST", COMPLETIONS, cases[i], timeout=300)
        if cases[i]["stream"]:
            events = sse_events(answer)
            got[i] = (status, "".join(e["choices"][0]["text"] for e in events[:-1]), None)
        else:
            got[i] = (status, answer["choices"][0]["text"], answer["usage"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        running.append(served.metrics.snapshot()["engine"]["running"])
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert max(running) > 1  # they were decoded together
    assert [got[i][0] for i in range(len(cases))] == [200] * len(cases)
    for i, case in enumerate(cases):
        if got[i][2] is not None:
            assert got[i][2]["completion_tokens"] == case["max_tokens"]
    idle(served)
    blocks = served.llm.engine.blocks
    assert blocks.n_used == 0
    blocks.check()
    alone = [post(served, COMPLETIONS, {**c, "stream": False})["choices"][0]["text"]
             for c in cases]
    assert [got[i][1] for i in range(len(cases))] == alone


def test_cancelled_stream_frees_its_blocks_at_the_next_step(served):
    idle(served)
    engine = served.llm.engine
    conn = served.connect(timeout=60)
    body = {"model": "tiny", "prompt": random_ids(random.Random(9), 100), "max_tokens": 900,
            "ignore_eos": True, "temperature": 0, "stream": True}
    conn.request("POST", COMPLETIONS, body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    (job,) = served.server.shutdown._jobs.values()
    assert engine.blocks.n_used > 0 and not job.cancelled.is_set()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 30
    while not job.cancelled.is_set():  # the server noticed the client leaving
        assert time.monotonic() < deadline
        time.sleep(0.001)
    steps = engine.steps
    while engine.blocks.n_used:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    # the step running when the flag was set may finish; the next one has the blocks back
    assert engine.steps - steps <= 1
    assert len(job.request.output_ids) < 900
    idle(served)
    engine.blocks.check()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_failing_choice_fails_the_response_and_frees_every_block(served, stream):
    weight = served.llm.model.norm.weight
    saved = weight.detach().clone()
    body = body_for(CHAT, "hi", max_tokens=4, n=3, seed=1, stream=stream)
    idle(served)
    with torch.no_grad():
        weight[0] = float("nan")  # every logit NaN: each choice fails
        try:
            status, r = served.request("POST", CHAT, body)
        finally:
            weight.copy_(saved)
    if stream:
        events = sse_events(r)
        assert status == 200 and events[-1] == "[DONE]"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error"
    else:
        assert status == 500 and r["error"]["code"] == "engine_error", r
    idle(served)
    assert served.llm.engine.blocks.n_used == 0
    served.llm.engine.blocks.check()
    assert post(served, CHAT, {**body, "stream": False})["usage"]["completion_tokens"] == 12


# ---- the CLI's flags: --alias, any model, a full queue --------------------------------------

def _metrics(server: ServerProcess) -> dict[str, float]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return metric_values(text)


def test_alias_any_model_id_and_503_with_retry_after_when_the_queue_is_full(tiny, tmp_path):
    server = ServerProcess(tiny, "--device", "cpu", "-c", "8192", "--alias", "tiny-alias",
                           "--max-seqs", "1", "--max-queue", "1", log_dir=tmp_path)
    try:
        status, models = server.request("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-alias"]
        assert server.request("GET", "/v1/models/gpt-4o")[1]["id"] == "tiny-alias"
        status, r = server.request("POST", COMPLETIONS, {"model": "gpt-4o", "prompt": "hi",
                                                         "max_tokens": 2})
        assert status == 200 and r["model"] == "tiny-alias"

        # A holds the one running slot (a long stream: 8000 tokens, 10 s or more here); B
        # waits for it in the engine: the queue is full
        a = server.connect(timeout=120)
        a.request("POST", COMPLETIONS, body=json.dumps({
            "model": "x", "prompt": "Once", "max_tokens": 8000, "ignore_eos": True,
            "stream": True}), headers={"Content-Type": "application/json"})
        assert a.getresponse().status == 200
        b: dict = {}
        waiter = threading.Thread(target=lambda: b.update(r=server.request(
            "POST", COMPLETIONS, {"model": "x", "prompt": "hi", "max_tokens": 2})))
        waiter.start()
        deadline = time.monotonic() + 60
        while True:
            m = _metrics(server)
            # B in the engine's queue, not only submitted (the worker counts the jobs it
            # took from its inbox at the end of the step it admitted them in)
            if (m["deimos_running_sequences"], m["deimos_waiting_sequences"],
                    m["deimos_queue_depth"]) == (1, 1, 1):
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        c = server.connect(timeout=60)
        c.request("POST", COMPLETIONS, body=json.dumps({"model": "x", "prompt": "hi",
                                                        "max_tokens": 1}),
                  headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        err = json.loads(resp.read())["error"]
        assert resp.status == 503 and resp.getheader("Retry-After") == "1"
        assert err["code"] == "queue_full" and "busy" in err["message"]
        c.close()
        a.sock.shutdown(socket.SHUT_RDWR)  # A leaves: B runs
        a.close()
        waiter.join(120)
        assert b["r"][0] == 200 and b["r"][1]["usage"]["completion_tokens"] == 2
        m = _metrics(server)
        assert m['deimos_requests_total{route="/v1/completions",status="503"}'] == 1
        assert not any(k.startswith("deimos_requests_total") and 'status="500"' in k for k in m)
    finally:
        server.close()


def test_a_request_with_more_choices_than_the_queue_holds_is_a_400(tiny, tmp_path):
    server = ServerProcess(tiny, "--device", "cpu", "-c", "256", "--max-queue", "2",
                           log_dir=tmp_path)
    try:
        status, r = server.request("POST", COMPLETIONS, {"model": "x", "prompt": "hi",
                                                         "max_tokens": 1, "n": 3})
        assert status == 400 and r["error"]["param"] == "n" and "--max-queue" in r["error"][
            "message"], r
        status, r = server.request("POST", COMPLETIONS, {"model": "x", "prompt": "hi",
                                                         "max_tokens": 1, "n": 2})
        assert status == 200 and len(r["choices"]) == 2
    finally:
        server.close()
