"""``deimos serve``: load the model, start the engine worker, run uvicorn (and the dashboard)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import uvicorn

from deimos.engine import LLM
from deimos.kernels.sampling import SamplingParams
from deimos.server.gate import Shutdown
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
    grace_s: float = 10.0  # after SIGTERM: how long requests in flight may run before the cut
    alias: str | None = None  # the model id /v1/models lists (default: the file's stem)
    # the engine (EngineConfig's fields; None: its default, as LLM picks it for the device)
    max_seqs: int | None = None
    max_batch_tokens: int | None = None
    kv_tokens: int | None = None
    kv_gib: float | None = None
    block_size: int | None = None
    prefix_cache: bool = True
    dense_weights: str | None = None  # auto, on, off (None: LLM's default, auto)
    experts: str | None = None  # auto, gpu, cpu (MoE models; None: auto)
    expert_cache_gib: float | None = None  # a fixed expert cache (None: elastic, from free memory)
    speculative: str | None = None  # speculative decoding: "ngram", "draft" or "mtp" (None: off)
    spec_k: int | None = None  # the most drafts a step verifies (None: SpecConfig's default)
    draft_model: str | None = None  # speculative "draft": the draft model's GGUF (or name)
    # variables every chat request's template gets (a request's chat_template_kwargs win)
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    def engine_options(self) -> dict[str, object]:
        """The keyword arguments of ``LLM(**...)`` that this config sets."""
        out: dict[str, object] = {k: getattr(self, k) for k in (
            "max_seqs", "max_batch_tokens", "kv_tokens", "kv_gib", "block_size", "dense_weights",
            "experts", "expert_cache_gib", "speculative", "spec_k", "draft_model")
            if getattr(self, k) is not None}
        if not self.prefix_cache:
            out["prefix_cache"] = False
        return out

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
    kv_bytes = llm.engine.pool.nbytes
    return {"model_weights": _tensor_bytes(llm.model, set()), "kv_cache": kv_bytes,
            "model_file": llm.file.file_size}


def model_id(path: Path, alias: str | None = None) -> str:
    """The id /v1/models shows: ``alias``, else the file's stem. Requests may name any model:
    this one answers."""
    return alias or path.stem


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


class ServeError(RuntimeError):
    """The server cannot start as configured (the address cannot be bound...)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, made before the model loads so a busy port fails
    in milliseconds; uvicorn is handed this socket."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a last run
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def warn_if_open(cfg: ServeConfig) -> None:
    """Loud, on stderr and in the log: an address beyond loopback with no API key is an open
    door to the model for anyone who can reach it."""
    if cfg.api_key is None and not is_loopback(cfg.host):
        msg = (f"WARNING: listening on {cfg.host}:{cfg.port}, beyond loopback, with no API key: "
               "anyone who can reach this address can use the model. Set an API key "
               "(--api-key or DEIMOS_API_KEY), or listen on 127.0.0.1.")
        print(f"deimos: {msg}", file=sys.stderr, flush=True)
        log.warning(msg)


def serve(cfg: ServeConfig) -> int:
    """Run the server until SIGTERM/SIGINT, then drain (see ``gate.Shutdown``): exit status 0
    after a drain, 2 when the address cannot be bound (before the model is loaded)."""
    from deimos.server.app import Server, create_app
    from deimos.server.metrics import Metrics
    from deimos.server.worker import EngineWorker

    warn_if_open(cfg)
    try:
        sock = bind_socket(cfg.host, cfg.port)
    except ServeError as e:
        print(f"deimos: error: {e} (--listen)", file=sys.stderr, flush=True)
        return 2
    try:
        llm = LLM(cfg.model, n_ctx=cfg.n_ctx, device=cfg.device, **cfg.engine_options())
        metrics = Metrics(memory_sizes(llm))
        worker = EngineWorker(llm, metrics, max_queue=cfg.max_queue)
        name = model_id(Path(llm.path), cfg.alias)
        server = Server(llm, worker, metrics, name, Defaults(cfg.sampling, cfg.max_tokens),
                        cfg.api_key, shutdown=Shutdown(cfg.grace_s),
                        template_kwargs=dict(cfg.template_kwargs))
        app = create_app(server)
        dash = _dashboard(metrics, name) if cfg.tui and sys.stdout.isatty() else None
        _setup_request_log(dash.log_handler() if dash is not None else None)
        worker.start()
        ecfg = llm.engine.cfg
        spec = f", {ecfg.spec.method} drafts up to {ecfg.spec.k_max}" if ecfg.spec else ""
        banner = (f"deimos: serving {name} (context {llm.n_ctx}, {ecfg.max_seqs} sequences at "
                  f"once, KV pool {llm.engine.blocks.usable * ecfg.block_size} tokens{spec}) on "
                  f"http://{_url_host(cfg.host)}:{sock.getsockname()[1]}/v1")
        try:
            DrainingServer(app, server.shutdown, banner, cfg.grace_s).run(sockets=[sock])
        finally:
            worker.stop()
            if dash is not None:
                dash.stop()
    finally:
        sock.close()
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class DrainingServer(uvicorn.Server):
    """uvicorn with our drain on SIGTERM/SIGINT: uvicorn stops accepting and waits for the
    open connections; ``Shutdown`` refuses new requests and cuts what is still running
    after the grace period, each with a final word. uvicorn re-raises a caught signal once
    it is done (so the process dies of it, status 143); a drained server exits 0 instead.
    A second signal forces the exit."""

    def __init__(self, app: object, shutdown: Shutdown, banner: str, grace_s: float) -> None:
        super().__init__(uvicorn.Config(
            app, log_level="warning", access_log=False,
            # the cut comes at grace_s; the margin lets the cut streams' last bytes go out
            timeout_graceful_shutdown=grace_s + 5))
        self.shutdown_state = shutdown
        self.banner = banner
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:  # accepting: only now is the address worth announcing
            print(self.banner, file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        if self.loop is not None:  # in a signal handler: the work goes to the loop
            self.loop.call_soon_threadsafe(self._drain, signal.Signals(sig).name)
        self.should_exit = True

    def _drain(self, why: str) -> None:
        print(f"deimos: {why}: draining ({self.shutdown_state.in_flight} requests in flight, "
              f"grace {self.shutdown_state.grace_s:g} s)", file=sys.stderr, flush=True)
        self.shutdown_state.begin()


def _dashboard(metrics: object, model_id: str):
    """The running terminal dashboard, or None (not a terminal, or not available)."""
    try:
        from deimos.server.dashboard import Dashboard
    except ImportError:
        log.warning("the terminal dashboard is not available; logging only")
        return None
    dash = Dashboard(metrics, title=f"deimos serve {model_id}")
    return dash if dash.start() else None
