"""The OpenAI-compatible HTTP server: protocol models, app, streaming, tools, dashboard."""
