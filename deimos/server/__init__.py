"""The OpenAI-compatible HTTP server (``deimos serve``).

    protocol    request bodies (pydantic; also the /openapi.json schema)
    params      body + prompt ids -> engine Request (sampling, limits, stops, processors)
    processors  logits processors: logit_bias, a JSON grammar constraint
    stops       stop strings on streamed text (held back until they cannot match)
    worker      the engine thread: every job decoded together (continuous batching), events
                to asyncio, cancellation at the next step
    choices     n > 1: one job per choice, their events merged
    responses   usage, logprobs formats, SSE lines
    app         routes; errors: OpenAI error objects, the one place faults are answered
    gate        the middleware every request passes: API key, body limit, drain (503, cuts),
                counts by the status the client got, the request log
    metrics     counters, speeds, memory (read by /metrics via prometheus_client, and the
                dashboard)
    tools       tool-call formats (prompting, parsing); tool_stream: a streamed reply's
                content sent as it comes, only what may be a tool call held (json_prefix:
                whether a "{..." text can still become JSON); dashboard: the terminal UI
    serve       bind, load the model, start worker + uvicorn (+ dashboard); drain on SIGTERM
"""
