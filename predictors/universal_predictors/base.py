"""The base of every predictor: one model per process, served by KServe's ModelServer.

A task subclasses :class:`UniversalPredictor`: ``load()`` (blocking, runs in a thread while the
server already answers 503 "loading"), a method per route its catalog entry names (bound by
:mod:`universal_predictors.binding`), ``infer()`` for KServe's v1/v2 protocols, ``unload()`` to give
memory back. Engine arguments are a pydantic model per
predictor: an unknown key stops the process at start-up with one line naming it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import kserve
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from pydantic import BaseModel, ValidationError

from universal_predictors import metrics, wake_phases
from universal_predictors.catalog import CATALOG, Backend, Catalog, Route, Task
from universal_predictors.config import PredictorConfig, resolve_source
from universal_predictors.engine_args import NoEngineArgs, flat_key, known_keys
from universal_predictors.errors import InvalidRequest, ModelNotFound, Unavailable
from universal_predictors.http import DEFAULT_MAX_BODY_BYTES, endpoint, error_response, parse_json

logger = logging.getLogger("universal_predictors")

Handler = Callable[..., Awaitable[Response]]

#: How often a loaded predictor asks its engine whether it can still serve.
HEALTH_INTERVAL_S = 2.0


class StartupError(Exception):
    """A configuration the predictor cannot start with; printed as one line, exit status 2."""


def parse_engine_args(model: type[BaseModel], raw: dict[str, str], where: str) -> Any:
    """Validate ``--engine-arg`` pairs against ``model``; StartupError names the first bad key."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = flat_key(model, tuple(first["loc"]))
        known = ", ".join(known_keys(model)) or "none"
        if first["type"] == "extra_forbidden":
            raise StartupError(f"engine arg {key!r} is not known to {where} (known: {known})") from None
        raise StartupError(f"engine arg {key!r}: {first['msg']} (for {where})") from None


class UniversalPredictor(kserve.Model):
    """One served model. Subclasses set ``task``, ``EngineArgs`` and implement the hooks."""

    task: ClassVar[Task]
    EngineArgs: ClassVar[type[BaseModel]] = NoEngineArgs

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__(config.model_name)
        self.config = config
        self.engine = True  # KServe awaits start_engine(): that is where loading runs, in the background
        self.backend: Backend = config.backend
        self.engine_args = parse_engine_args(
            self.EngineArgs,
            config.engine_args_for(config.backend),
            f"the {config.backend.value} backend of task {self.task.value}",
        )
        self.loaded_at: float | None = None

    # -- hooks -------------------------------------------------------------------------------------

    def load(self) -> bool:
        """Load the model (blocking; runs in a worker thread). Set ``self.backend`` to what was chosen."""
        raise NotImplementedError

    def unload(self) -> None:
        """Drop the model and give its memory back."""

    def add_routes(self, router: APIRouter, catalog: Catalog = CATALOG) -> None:
        """Bind the task's routes, as its catalog entry lists them, to this predictor's methods."""
        from universal_predictors.binding import bind_routes

        [entry] = [entry for entry in catalog.tasks if entry.name == self.task.value]
        bind_routes(self, router, entry.routes)

    #: Whether a client that leaves cancels its request's work (decoding, a PDF render, queued pages).
    stop_on_disconnect: ClassVar[bool] = False

    async def read_request(self, route: Route, request: Request) -> tuple[str | None, Any]:
        """A POST route's body: the model it names and what the route's method takes. By default the
        route's request model, read from JSON within :meth:`max_body_bytes` (400/413 naming the field)."""
        from universal_predictors.binding import request_model

        assert route.request is not None
        body: Any = await parse_json(request, request_model(route.request), self.max_body_bytes(route),
                                     self.precheck(route))  # fmt: skip
        return body.model, body

    def max_body_bytes(self, route: Route) -> int:
        """The largest body ``route`` reads (413 beyond)."""
        return DEFAULT_MAX_BODY_BYTES

    def precheck(self, route: Route) -> Callable[[dict[str, Any]], None] | None:
        """What sees ``route``'s parsed JSON before its model validates it (counts and sizes), if anything."""
        return None

    async def infer(self, instances: list[Any]) -> list[Any]:
        """KServe v1/v2: a list of inputs (strings or JSON values) to a list of outputs."""
        raise InvalidRequest(f"task {self.task.value} does not take KServe v1/v2 inference requests")

    def describe(self) -> dict[str, Any]:
        """Extra fields for ``/openai/v1/models``."""
        return {}

    def health(self) -> str | None:
        """None while the loaded model can serve; otherwise why not (a dead engine process, a sticky
        device error). Non-blocking. Once loaded, a reason makes readiness fail and the process exit."""
        return None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """KServe calls this at registration; readiness waits for :meth:`start_engine`."""

    async def start_engine(self) -> None:
        try:
            await self.load_and_serve()
        except Exception as exc:
            logger.exception("loading %s failed", self.name)
            print(f"universal_predictors: error: loading {self.name!r} failed: {exc}", file=sys.stderr, flush=True)
            # Exit so Kubernetes (or the local supervisor) sees the failure and its last log lines.
            os._exit(1)

    async def load_and_serve(self) -> None:
        """Load (off the event loop), then answer ready and watch the engine's health; a failed load raises (the
        process's own predictor exits on it: :meth:`start_engine`; a shared host's member fails alone)."""
        started = time.monotonic()
        logger.info("loading %s (task %s, backend %s) from %s", self.name, self.task.value, self.backend.value,
                    self.config.source)  # fmt: skip
        read = await asyncio.to_thread(wake_phases.CLOCK.read_weights, resolve_source(self.config.source))
        if read:
            logger.info("read %.0f MB of weights not in the page cache in %.2fs", read / 2**20,
                        wake_phases.CLOCK.seconds["weights"])  # fmt: skip
        await asyncio.to_thread(self.load)
        # What loading made (hundreds of thousands of objects: modules, tokenizer tables, tensor
        # wrappers) lives as long as the model: frozen, a full collection no longer walks it. Measured
        # with all-MiniLM-L6-v2: 250 ms full collections, every request in flight held, every few
        # thousand requests.
        gc.collect()
        gc.freeze()
        self.loaded_at = time.time()
        self.ready = True
        phases = wake_phases.CLOCK.ready()
        for phase, seconds in phases.items():
            metrics.LOAD_SECONDS.labels(model=self.name, phase=phase).set(seconds)
        logger.info("%s is ready (backend %s, %.1fs; %s)", self.name, self.backend.value, time.monotonic() - started,
                    wake_phases.CLOCK.describe())  # fmt: skip
        self._health_watch = asyncio.create_task(self.watch_health(), name="health-watch")

    async def watch_health(self, interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Exit the process once :meth:`health` reports the model can no longer serve.

        A replica whose engine died would otherwise stay Ready and answer every request with a 500. The
        exit is what lets Kubernetes (or the local supervisor) restart it; readiness already fails from the
        moment the reason appears (``/v2/health/ready`` asks :meth:`health` itself)."""
        while True:
            await asyncio.sleep(interval_s)
            if not self.ready:  # stopping: unloading ends the engine on purpose
                return
            reason = self.health()
            if reason is not None:
                self.ready = False
                logger.error("%s can no longer serve: %s; exiting", self.name, reason)
                print(f"universal_predictors: error: {self.name!r} can no longer serve: {reason}", file=sys.stderr,
                      flush=True)  # fmt: skip
                os._exit(1)

    def stop(self) -> None:
        self.ready = False
        gc.unfreeze()  # what unloading lets go of may hold cycles: back within the collector's reach
        self.unload()

    def stop_engine(self) -> None:
        self.ready = False

    # -- shared request helpers --------------------------------------------------------------------

    def require_ready(self) -> None:
        if not self.ready:
            raise Unavailable(
                f"The model {self.name!r} is loading; retry shortly.", code="model_loading", retry_after=5
            )

    def check_model(self, requested: str | None) -> None:
        """404 when the body names another model (task routes may omit it)."""
        if requested is not None and requested != self.name:
            raise ModelNotFound(requested, self.name)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": int(self.loaded_at or time.time()),
            "owned_by": "universal-runtime",
            "task": self.task.value,
            "backend": self.backend.value,
            "ready": self.ready,
            **self.describe(),
        }

    def model_cards(self) -> list[dict[str, Any]]:
        """``/openai/v1/models``' entries: the model's card (and, where a task has them, its adapters')."""
        return [self.model_card()]

    def route(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator for task routes: metrics, OpenAI errors, no stack traces."""
        return endpoint(name, lambda: self.name)

    # -- KServe v1 / v2 ----------------------------------------------------------------------------

    async def predict(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        self.require_ready()
        if isinstance(payload, InferRequest):
            if not payload.inputs:
                raise InvalidRequest("the v2 request has no inputs")
            tensor = payload.inputs[0]
            values: list[Any] = _tensor_values(tensor)
            results = await self.infer(values)
            encoded = [r if isinstance(r, str) else json.dumps(r) for r in results]
            output = InferOutput(name="output", shape=[len(encoded)], datatype="BYTES", data=encoded)
            return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=self.name,
                                 infer_outputs=[output])  # fmt: skip
        if not isinstance(payload, dict) or not isinstance(payload.get("instances"), list):
            raise InvalidRequest('a v1 request is {"instances": [...]}')
        return {"predictions": await self.infer(payload["instances"])}


def _tensor_values(tensor: Any) -> list[Any]:
    """A v2 input tensor's elements: strings for BYTES (JSON sends str, binary sends bytes), else numbers."""
    if tensor.datatype != "BYTES":
        return list(tensor.as_numpy().tolist())
    flat: list[Any] = []
    stack = [tensor.data]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(reversed(item))
        else:
            flat.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
    return flat


def common_routes(predictor: UniversalPredictor) -> APIRouter:
    """Routes every predictor has: truthful readiness and the OpenAI model list."""
    router = APIRouter()

    async def ready() -> Response:
        # KServe's own /v2/health/ready answers 200 before any model is loaded; this one does not, nor
        # once the engine behind a loaded model has died (the health watch then ends the process).
        reason = predictor.health() if predictor.ready else None
        if predictor.ready and reason is None:
            return JSONResponse({"ready": True})
        if reason is not None:
            return error_response(Unavailable(f"{predictor.name}: {reason}", code="engine_dead", retry_after=5))
        return error_response(Unavailable(f"{predictor.name} is loading", code="model_loading", retry_after=5))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": predictor.model_cards()})

    router.add_api_route("/v2/health/ready", ready, methods=["GET"])
    router.add_api_route("/openai/v1/models", models, methods=["GET"])
    return router
