"""Asynchronous streaming client: sends a workload's token-id prompts to ``/v1/completions``.

Each request is sent with ``stream=True`` and ``stream_options.continuous_usage_stats`` so every
server-sent chunk carries the running ``completion_tokens`` count (vLLM's OpenAI server supports
both); ``ignore_eos`` makes the server generate exactly ``max_tokens`` tokens, so runs of
different arms do the same work.  TTFT is send -> first chunk carrying a completion token; ITL is
the gap between chunks divided by the tokens the later chunk added.

Several servers (``replica_urls``): request number ``k`` of the workload (0-based, workload order)
goes to server ``k mod N``, as a round-robin load balancer without session affinity spreads
requests over replicas; the assignment depends on the workload alone, so every arm and run sends
each request to the same replica index.  Each result records its replica.  With a planned restart
(``restart``, :mod:`kvtier.bench.restart`) the restarted replica's turns go to the live replicas
while it is down.

Scheduling: requests of one session go one after another (``think_time_s`` after the previous
finished); every chain waits for its request's ``arrival_s``; at most ``max_concurrency`` requests
are in flight.  ``should_stop`` is polled twice a second: when it returns a reason (the engine
process died), in-flight requests are cancelled and recorded as failed, unsent ones as not sent.
A request that receives no new completion token for ``stall_timeout_s`` (bytes without a token,
e.g. a server or proxy that trickles, do not count) fails as a stall; with
``abort_on_stall`` the run stops there (the engine is taken as hung).  A stream that goes on past
:func:`max_stream_tokens` completion tokens fails at once (a server that ignores ``max_tokens``
reset the stall deadline with every token and held the run forever), so one request waits at most
``stall_timeout_s`` x (that bound + 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvtier.bench.restart import RestartHook, Router, restart_replica
from kvtier.bench.results import NOT_SENT, RequestResult, RestartEvent, RunResult
from kvtier.bench.workload import BenchRequest, Workload


@dataclass(frozen=True)
class ClientOptions:
    """How to send.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000``.
        model: the served model name (``/v1/models``).
        max_concurrency: requests in flight at most; ``None`` = unlimited.
        stall_timeout_s: seconds without a new completion token before a request fails (an
            error answer's body is read within the same deadline).
        abort_on_stall: stop the whole run at the first stalled request.
        progress: draw a rich progress bar.
        replica_urls: server roots to spread the requests over round robin (see the module
            docstring); empty = every request to ``base_url``.
    """

    base_url: str
    model: str
    max_concurrency: int | None = None
    stall_timeout_s: float = 300.0
    abort_on_stall: bool = False
    progress: bool = True
    replica_urls: tuple[str, ...] = ()

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers requests go to, in replica order."""
        return self.replica_urls or (self.base_url,)


class _Abort(Exception):
    """Raised inside the run to stop every chain."""


def _payload(request: BenchRequest, model: str) -> dict[str, object]:
    return {"model": model, "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def max_stream_tokens(max_tokens: int) -> int:
    """Completion tokens a stream may carry before the request fails as over-long: twice
    ``max_tokens`` plus 16, room for a server that counts a closing chunk without usage as a token,
    and a bound on the wait for one that never stops."""
    return 2 * max_tokens + 16


MAX_REASON_CHARS = 200
"""Longest server message kept in a failed request's reason (characters)."""

_ERROR_BODY_BYTES = 4096
"""Bytes of a non-200 answer read for its message (the rest is not waited for)."""


def server_message(body: str) -> str:
    """The message of a server's error answer, at most MAX_REASON_CHARS characters: the
    ``message`` of an OpenAI-style ``{"error": {"message": ...}}`` (or vLLM's older
    ``{"object": "error", "message": ...}``), else the text itself."""
    text = body.strip()
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        parsed = json.loads(text)
        inner = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            text = inner["message"]
        elif isinstance(inner, str):
            text = inner
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


async def _error_body(response: httpx.Response) -> str:
    """The start of a non-200 answer's body (at most _ERROR_BODY_BYTES; the caller's deadline
    bounds the wait)."""
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= _ERROR_BODY_BYTES:
            break
    return bytes(body[:_ERROR_BODY_BYTES]).decode("utf-8", "replace")


async def _send(client: httpx.AsyncClient, request: BenchRequest, options: ClientOptions,
                t_run: float, replica: int = 0) -> RequestResult:
    """Send one request and time its stream; never raises for server-side failures.

    The stall deadline is progress, not bytes: the request fails as a stall when no new
    completion token arrived for ``stall_timeout_s`` (counted from the send, then from each
    token), so a server that trickles bytes without tokens cannot hold it."""
    t0 = time.perf_counter()
    start_s = t0 - t_run
    ttft: float | None = None
    last_t = t0
    tokens = 0
    done = False
    gaps: list[float] = []
    loop = asyncio.get_running_loop()

    def failed(error: str) -> RequestResult:
        return RequestResult(request.request_id, request.prompt_len, tokens, start_s, ttft, None, tuple(gaps), error,
                             replica)

    try:
        async with asyncio.timeout(options.stall_timeout_s) as deadline:
            async with client.stream("POST", "/v1/completions", json=_payload(request, options.model)) as response:
                if response.status_code != 200:
                    return failed(f"HTTP {response.status_code}: {server_message(await _error_body(response))}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # vLLM streams a rejected prompt's error as a chunk, status 200
                        error = chunk["error"]
                        code = f" {error['code']}" if isinstance(error, dict) and error.get("code") else ""
                        return failed(f"server error{code}: {server_message(json.dumps(chunk))}")
                    usage = chunk.get("usage") or {}
                    choices = chunk.get("choices") or []
                    if "completion_tokens" in usage:
                        count = int(usage["completion_tokens"])
                    else:  # a server without continuous usage: one token per choice chunk
                        count = tokens + (1 if choices else 0)
                    if count > (bound := max_stream_tokens(request.max_tokens)):
                        return failed(f"the stream went past {bound} completion tokens for max_tokens "
                                      f"{request.max_tokens} without ending; the server ignores max_tokens")
                    new = count - tokens
                    if new <= 0:
                        continue
                    deadline.reschedule(loop.time() + options.stall_timeout_s)
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                        new -= 1  # the first token has a TTFT, not an ITL
                    if new > 0:
                        gaps.extend([(now - last_t) / new] * new)
                    last_t = now
                    tokens = count
    except (TimeoutError, httpx.ReadTimeout):
        return failed(f"stall: no new token for {options.stall_timeout_s:g} s")
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if tokens == 0:
        return failed("the stream ended without a completion token")
    if not done:  # the connection closed mid-stream: a server that died, not a finished request
        return failed("the stream ended before [DONE]")
    return RequestResult(request.request_id, request.prompt_len, tokens, start_s, ttft, end - t0, tuple(gaps),
                         replica=replica)


async def _wait_for_stop(should_stop: Callable[[], str | None], seconds: float) -> str | None:
    """Poll ``should_stop`` for up to ``seconds``; its reason, or ``None`` if the server lives on."""
    deadline = time.perf_counter() + seconds
    while True:
        reason = should_stop()
        if reason is not None or time.perf_counter() >= deadline:
            return reason
        await asyncio.sleep(0.25)


def _chains(workload: Workload) -> list[list[BenchRequest]]:
    """Session requests grouped in order; every other request is a chain of its own."""
    chains: list[list[BenchRequest]] = []
    by_session: dict[str, list[BenchRequest]] = {}
    for request in workload.requests:
        if request.session is None:
            chains.append([request])
        elif request.session in by_session:
            by_session[request.session].append(request)
        else:
            by_session[request.session] = [request]
            chains.append(by_session[request.session])
    return chains


@dataclass
class _RunState:
    """Mutable bookkeeping of one run (single event loop, so no locks)."""

    t_run: float
    results: dict[str, RequestResult] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)
    aborted: str | None = None
    failed_at: tuple[str, ...] = ()
    num_ok: int = 0
    num_failed: int = 0
    restart: RestartEvent | None = None

    def abort(self, reason: str) -> None:
        """Stop the run for ``reason``; the requests in flight are where it happened."""
        if self.aborted is None:
            self.aborted = reason
            self.failed_at = tuple(sorted(self.in_flight))


async def run_workload_async(workload: Workload, options: ClientOptions,
                             should_stop: Callable[[], str | None] | None = None,
                             restart: RestartHook | None = None) -> RunResult:
    """Send the whole workload; see the module docstring for the rules, and
    :mod:`kvtier.bench.restart` for ``restart`` (waited for before this returns).  Never raises
    for a failing server: failures are in the returned results."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    state = _RunState(t_run=time.perf_counter())
    sem = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    limits = httpx.Limits(max_connections=options.max_concurrency or 1000, max_keepalive_connections=100)
    timeout = httpx.Timeout(connect=30.0, read=options.stall_timeout_s, write=60.0, pool=None)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("ok {task.fields[ok]} failed {task.fields[failed]}"), TimeElapsedColumn(),
                        disable=not options.progress, transient=False)
    task_id = progress.add_task(workload.name, total=len(workload.requests), ok=0, failed=0)

    async def failure_reason(request: BenchRequest, error: str) -> str | None:
        if error.startswith("stall") and options.abort_on_stall:
            return f"engine hung: request {request.request_id} received no new token for {options.stall_timeout_s:g} s"
        if should_stop is not None and not error.startswith("HTTP 4"):
            return await _wait_for_stop(should_stop, seconds=3.0)  # a dying server exits shortly after
        return None

    urls = options.urls
    router = Router(len(urls), [r.request_id for r in workload.requests], restart.plan if restart else None)
    restarting: list[asyncio.Task[None]] = []

    async def restart_in_background(clients: list[httpx.AsyncClient], stack: contextlib.AsyncExitStack) -> None:
        assert restart is not None

        async def reconnect(replica: int) -> None:  # a fresh connection pool for the new server
            clients[replica] = await stack.enter_async_context(
                httpx.AsyncClient(base_url=urls[replica], timeout=timeout, limits=limits))

        event = await restart_replica(router, restart, state.t_run, reconnect)
        state.restart = event
        if event.error is not None:
            state.abort(f"replica {event.replica} did not come back after its planned restart: {event.error}")

    async def one(clients: list[httpx.AsyncClient], request: BenchRequest) -> RequestResult:
        # the request stays "in flight" (and holds its concurrency slot) until its failure is
        # judged, so the report names it and no new request is sent to a server that just died
        state.in_flight.add(request.request_id)
        if router.restart_due():
            restarting.append(asyncio.create_task(restart_in_background(clients, stack)))
        while router.held(request.request_id) and state.aborted is None:  # bounded by the restart's deadlines
            await asyncio.sleep(0.05)
        replica = router.pick(request.request_id)
        try:
            result = await _send(clients[replica], request, options, state.t_run, replica)
            if result.error is not None:
                reason = await failure_reason(request, result.error)
                if reason is not None:
                    state.abort(reason)
            return result
        finally:
            router.done(replica)
            state.in_flight.discard(request.request_id)

    async def chain(clients: list[httpx.AsyncClient], requests: list[BenchRequest]) -> None:
        prev_end: float | None = None
        for request in requests:
            target = request.arrival_s
            if prev_end is not None:
                target = max(target, prev_end + request.think_time_s)
            delay = target - (time.perf_counter() - state.t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                async with sem:
                    if state.aborted is not None:
                        return
                    result = await one(clients, request)
            else:
                result = await one(clients, request)
            state.results[request.request_id] = result
            prev_end = time.perf_counter() - state.t_run
            if result.ok:
                state.num_ok += 1
            else:
                state.num_failed += 1
            progress.update(task_id, advance=1, ok=state.num_ok, failed=state.num_failed)
            if state.aborted is not None:
                raise _Abort

    async def watch(tasks: list[asyncio.Task[None]]) -> None:
        while not all(t.done() for t in tasks):
            reason = should_stop() if should_stop is not None else None
            if reason is not None:
                state.abort(reason)
            if state.aborted is not None:
                for t in tasks:
                    t.cancel()
                return
            await asyncio.sleep(0.5)

    with progress:
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits))
                       for url in urls]
            tasks = [asyncio.create_task(chain(clients, c)) for c in _chains(workload)]
            watcher = asyncio.create_task(watch(tasks))
            await asyncio.gather(*tasks, return_exceptions=True)
            await watcher
            for task in restarting:  # bounded by the restart's own drain, stop and start deadlines
                await task
    duration = time.perf_counter() - state.t_run
    ordered = []
    for request in workload.requests:
        if request.request_id in state.results:
            ordered.append(state.results[request.request_id])
            continue
        # cancelled in flight: it failed where the run stopped; never started: not sent
        error = str(state.aborted) if request.request_id in state.failed_at else f"{NOT_SENT}: {state.aborted}"
        ordered.append(RequestResult(request.request_id, request.prompt_len, 0, 0.0, None, None, (), error,
                                     router.home[request.request_id]))
    return RunResult(results=tuple(ordered), duration_s=duration, aborted=state.aborted, failed_at=state.failed_at,
                     restart=state.restart)


def run_workload(workload: Workload, options: ClientOptions,
                 should_stop: Callable[[], str | None] | None = None,
                 restart: RestartHook | None = None) -> RunResult:
    """Blocking form of :func:`run_workload_async`."""
    return asyncio.run(run_workload_async(workload, options, should_stop, restart))
