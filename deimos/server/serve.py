"""``deimos serve``: load the model, start the engine worker, run uvicorn (and the dashboard)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from deimos.engine import LLM
from deimos.kernels.sampling import SamplingParams
from deimos.server.params import Defaults

log = logging.getLogger("deimos.server")


@dataclass(frozen=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    n_ctx: int | None = None
    api_key: str | None = None
    sampling: SamplingParams = SamplingParams()
    max_tokens: int | None = None  # default for requests that give none; None: the context
    max_queue: int = 64
    tui: bool = True  # the dashboard, when stdout is a terminal
    device: str = "cpu"  # "cuda": the GPU path (the CLI picks it when a GPU is there)

    @staticmethod
    def parse_listen(listen: str) -> tuple[str, int]:
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"--listen must be HOST:PORT (e.g. 127.0.0.1:8080), got {listen!r}")
        return host.strip("[]") or "127.0.0.1", int(port)


def _tensor_bytes(obj: object, seen: set[int], depth: int = 0) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj``'s attributes."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if depth > 6:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen, depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(x, seen, depth + 1) for x in vars(obj).values())
    return 0


def memory_sizes(llm: LLM) -> dict[str, int]:
    kv = llm.generator.kv
    kv_bytes = sum(t.nbytes for t in kv.k) + sum(t.nbytes for t in kv.v)
    return {"model_weights": _tensor_bytes(llm.model, set()), "kv_cache": kv_bytes,
            "model_file": llm.file.file_size}


def model_names(model_arg: str, path: Path) -> tuple[str, frozenset[str]]:
    """The id /v1/models shows (the file's stem) and the other names a request may use."""
    return path.stem, frozenset({model_arg, path.name, str(path)})


def _setup_request_log(handler: logging.Handler | None = None) -> None:
    """JSON lines on stderr, or through the dashboard's console (above its live view)."""
    req_log = logging.getLogger("deimos.requests")
    if not req_log.handlers:
        if handler is None:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
        req_log.addHandler(handler)
    req_log.setLevel(logging.INFO)
    req_log.propagate = False


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    from deimos.server.app import Server, create_app
    from deimos.server.metrics import Metrics
    from deimos.server.worker import EngineWorker

    llm = LLM(cfg.model, n_ctx=cfg.n_ctx, device=cfg.device)
    metrics = Metrics(memory_sizes(llm))
    worker = EngineWorker(llm, metrics, max_queue=cfg.max_queue)
    model_id, aliases = model_names(cfg.model, Path(llm.path))
    server = Server(llm, worker, metrics, model_id, aliases,
                    Defaults(cfg.sampling, cfg.max_tokens), cfg.api_key)
    app = create_app(server)
    dash = _dashboard(metrics, model_id) if cfg.tui and sys.stdout.isatty() else None
    _setup_request_log(dash.log_handler() if dash is not None else None)
    worker.start()
    print(f"deimos: serving {model_id} (context {llm.n_ctx}) on http://{cfg.host}:{cfg.port}/v1",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run()
    finally:
        worker.stop()
        if dash is not None:
            dash.stop()
    return 0


def _dashboard(metrics: object, model_id: str):
    """The running terminal dashboard, or None (not a terminal, or not available)."""
    try:
        from deimos.server.dashboard import Dashboard
    except ImportError:
        log.warning("the terminal dashboard is not available; logging only")
        return None
    dash = Dashboard(metrics, title=f"deimos serve {model_id}")
    return dash if dash.start() else None
