"""``flare run``: serve a model over the OpenAI-compatible HTTP API.

With no arguments it serves the embedded default model (``models/default``) on
127.0.0.1:8000 (``flare run MODEL`` or ``--model`` another; vLLM's spellings of the
flags are accepted too, ``ops.vllm_flags``). Every flag, the model directory, the device
and the port are checked before anything is prepared (``ops.startup_checks``): a failure
is one line naming the cause and the flag or file, with exit status 2 (JSON under
``--log-format json``). The listening socket is bound then and handed to the server.
Preparation is logged (``runtime.preparing`` / ``runtime.prepared``), readiness is logged
with the bound address (``server.ready``). SIGINT/SIGTERM start a graceful shutdown: stop
admitting, let in-flight requests finish within ``--shutdown-grace`` seconds, end the rest
with an error event, close the runtime. A second signal ends every open request at once
(streams still get their error event), closes the same way and exits with status
``128 + signal`` (130 after SIGINT, 143 after SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import socket
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial

import structlog
import trio

from actors.config import (
    DEFAULT_DRAFT_CATCH_UP,
    DEFAULT_DRAFT_DEPTH,
    DEFAULT_MAX_BATCH,
    DEFAULT_WINDOW_IMAGES,
    DTYPE_CHOICES,
    LOGPROBS_MODES,
    SCHEDULER_POLICIES,
    ConfigError,
    RuntimeConfig,
    SpeculationSetting,
)
from actors.public import Runtime
from actors.system import open_runtime
from app import (
    AppSettings,
    ServerHandle,
    bind_listener,
    configure_logging,
    create_app,
    serve_http,
)
from app.chat_template import load_chat_template
from app.connections import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_WRITE_TIMEOUT_S,
    ConnectionSettings,
)
from app.image_parts import DEFAULT_IMAGE_LIMITS, ImageLimits
from app.log_config import LOG_FORMATS
from app.parse_workers import DEFAULT_PARSE_WORKERS, MAX_PARSE_WORKERS
from app.service import DEFAULT_MAX_REQUEST_BYTES
from ops.engine_flags import add_engine_flags, engine_config
from ops.startup_checks import (
    STARTUP_FAILURES,
    StartupError,
    check_backend,
    check_model_dir,
    report_failure,
    startup_cause,
)
from ops.vllm_flags import add_vllm_arguments, model_dir, prefill_capacities, prefix_caching
from policy import ADMISSION_ORDERS

log = structlog.get_logger("flare.run")

OpenRuntime = Callable[[RuntimeConfig], AbstractAsyncContextManager[Runtime]]
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_GRACE_S = 30.0
# A forced stop (a second signal) exits with the shell's convention for a signal death.
FORCED_EXIT_BASE = 128
REQUEST_LOGGER = "flare.app.requests"
"""The logger of per-request lifecycle records (``app.generation``)."""
FORCED_STOP_MESSAGE = "The server was stopped (second signal) before this request finished."


def _capacities(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 64,256,1024, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one capacity")
    return values


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


def _origins(text: str) -> tuple[str, ...]:
    origins = tuple(part.strip().rstrip("/") for part in text.split(",") if part.strip())
    bad = [o for o in origins if o != "*" and "://" not in o]
    if bad:
        raise argparse.ArgumentTypeError(
            f"expected origins such as https://app.example.com or *, got {bad[0]!r}")
    return origins


def _image_limit(text: str) -> int:
    """``--limit-mm-per-prompt``: ``N`` or vLLM's ``{"image": N}``."""
    try:
        value = json.loads(text)
        count = value.get("image", 0) if isinstance(value, dict) else value
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
    except (json.JSONDecodeError, AttributeError):
        pass
    raise argparse.ArgumentTypeError(f'expected N or {{"image": N}} with N >= 0, got {text!r}')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("model_path", nargs="?", type=pathlib.Path, default=None,
                       metavar="MODEL", help="HF-format model directory (the same as --model)")
    model.add_argument("--model", type=pathlib.Path, default=None,
                       help="HF-format model directory (default: the embedded default model)")
    model.add_argument("--draft-model", type=pathlib.Path, default=None,
                       help="draft model directory for learned speculative proposals")
    model.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="serving dtype (default auto: the checkpoint's torch_dtype where "
                            "the backend runs it; float32 or bfloat16 or float16 on the CPU)")
    model.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                       help="reported logprobs: raw_logprobs (the model's distribution, "
                            "default) or processed_logprobs (the one each token is drawn from)")
    add_engine_flags(model)
    model.add_argument("--nnodes", type=int, default=1, metavar="M",
                       help="CPU, with -tp: the group spans M machines; this one serves "
                            "with the first N/M ranks, each other machine runs flare rank "
                            "--node-rank K (MASTER_ADDR/MASTER_PORT: an address all reach)")
    model.add_argument("--max-context", "--max-model-len", dest="max_context", type=int,
                       default=None,
                       help="context length (default: the model's max_position_embeddings; "
                            "a larger value is lowered to it, with a warning)")
    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int,
                       default=DEFAULT_MAX_BATCH,
                       help="most requests in one decode batch (1..64; programs are "
                            "prepared for the powers of two up to it, rounded up)")
    sched.add_argument("--prefill-capacity", type=_capacities, default=None,
                       help="prefill token capacities, comma separated multiples of 64 "
                            "(default 64,256,1024)")
    sched.add_argument("--mixed-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="prepare mixed prefill/decode programs (families that declare "
                            "them; default: on without speculation, off with it)")
    sched.add_argument("--no-speculative-mixed", action="store_false", dest="speculative_mixed",
                       help="with adaptive speculation and --mixed-prefill: prepare only the "
                            "width-one mixed programs, so a frame carrying a prompt chunk "
                            "verifies no drafts (flare's extension, opt-in; the seed's "
                            "MIX-41/MIX-43 add wider ones)")
    sched.add_argument("--speculation", choices=("off", "fixed", "adaptive"), default=None,
                       help="speculative decoding mode (default: adaptive with --draft-model "
                            "or --draft-source copy, otherwise off)")
    sched.add_argument("--draft-source", choices=("draft", "copy"), default=None,
                       help="speculative proposals from the draft model (draft, the default; "
                            "needs --draft-model) or copied from the request's own history "
                            "(copy)")
    sched.add_argument("--draft-depth", type=int, default=DEFAULT_DRAFT_DEPTH,
                       help="proposal depth D of a speculative load (1..7): programs of "
                            "widths 1..D+1 are prepared")
    sched.add_argument("--draft-catch-up", type=int, default=DEFAULT_DRAFT_CATCH_UP,
                       help="learned draft: K > 0 lets ordinary decodes skip the draft model; "
                            "the next speculative round re-feeds it at most K missed positions "
                            f"(default {DEFAULT_DRAFT_CATCH_UP}: the draft runs on every decode "
                            "step, the seed's rule)")
    sched.add_argument("--no-draft-counterfactuals", action="store_true",
                       help="adaptive learned speculation: learn acceptance only from verified "
                            "rounds (the seed's rule) instead of also comparing the draft's "
                            "proposal on width-one steps with the emitted token")
    sched.add_argument("--no-copy-counterfactuals", action="store_true",
                       help="adaptive copy speculation: learn copy acceptance only from "
                            "verified rounds (the seed's rule) instead of also replaying the "
                            "copy lookup on frames that verified no drafts")
    sched.add_argument("--speculative-token-capacity", type=int, default=0,
                       help="bound R on aggregate target rows of speculative programs (0 = B*W)")
    sched.add_argument("--speculative-allocation", choices=("host", "device"), default="host",
                       help="who allocates target rows of speculative rounds: host lengths "
                            "only, or also ragged device-allocated programs (adaptive only)")
    sched.add_argument("--scheduler-policy", choices=SCHEDULER_POLICIES,
                       default="balanced",
                       help="balanced (default) or throughput: throughput keeps token fairness "
                            "and output value but drops delivery fairness and decode-age price; "
                            "fcfs, sarathi, vtc and fixed-spec-K (K drafts verified on every "
                            "decode step; needs a speculative load of depth >= K) are baseline "
                            "policies on the same programs (for comparisons, see "
                            "docs/simulator.md); first-token, client-fair and smooth are "
                            "flare's opt-in presets (docs/scheduling-utility.md; smooth keeps "
                            "prompt chunks below a GPU's throughput knee while streams decode)")
    sched.add_argument("--scheduler-terminal-value", type=float, default=None,
                       help="override the terminal service value (finite, >= 0; 0 disables)")
    sched.add_argument("--scheduler-terminal-age-price", type=float, default=None,
                       help="override the terminal age price (finite, >= 0; 0 disables)")
    sched.add_argument("--mtp-adaptive-verification-alpha", type=float, default=None,
                       help="exponent on prefix-survival estimates in speculative selection "
                            "scores (default 1; finite, > 0): above 1 discounts uncertain long "
                            "prefixes and favours narrower verification, below 1 favours wider")
    sched.add_argument("--cost-drift-weight", type=float, default=None,
                       help="share of each program's measured cost change applied to every "
                            "program's estimate, as a common speed factor (0..1; default 0.1 "
                            "on cpu, whose speed drifts, and 0 on cuda; 0 keeps the seed's "
                            "per-program medians; docs/scheduling-utility.md)")
    sched.add_argument("--decode-prompt-tail", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="feed a request's one uncached prompt token (a prompt found whole "
                            "in the prefix cache, or a one-token prompt) to its first decode "
                            "step instead of a prefill chunk (default on; docs/runtime.md)")
    sched.add_argument("--max-queue", type=int, default=64,
                       help="bounded admission queue; beyond it requests get 429")
    sched.add_argument("--admission-order", choices=ADMISSION_ORDERS, default="fifo",
                       help="which waiting request gets the next free row (docs/runtime.md)")
    sched.add_argument("--kv-pages", type=int, default=None, help="KV cache pages in the pool")
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    http.add_argument("--port", type=_port, default=DEFAULT_PORT, help="port (0 picks a free one)")
    http.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1/* (env FLARE_API_KEY)")
    http.add_argument("--metrics-require-key", action="store_true",
                      help="with --api-key, /metrics requires the key too")
    http.add_argument("--allowed-origins", type=_origins, default=(),
                      help="comma-separated origins (or *) answered with CORS headers "
                           "(default: none, browsers refuse cross-origin calls)")
    http.add_argument("--limit-mm-per-prompt", type=_image_limit, default=DEFAULT_IMAGE_LIMITS.max_images,
                      metavar="N", help='images per request, N or {"image": N} (default '
                      f'{DEFAULT_IMAGE_LIMITS.max_images}; docs/vision.md)')
    http.add_argument("--vision-feature-images", type=int, default=DEFAULT_WINDOW_IMAGES,
                      metavar="N",
                      help="vision-language checkpoints: images whose encoded features the "
                           "feature storage keeps, the images of one prefill window (default "
                           f"{DEFAULT_WINDOW_IMAGES}; a stored image is not re-encoded)")
    http.add_argument("--max-image-bytes", type=int, default=DEFAULT_IMAGE_LIMITS.max_bytes,
                      metavar="N", help="largest decoded image, in bytes (413 beyond it; "
                                        f"default {DEFAULT_IMAGE_LIMITS.max_bytes})")
    http.add_argument("--max-image-pixels", type=int, default=DEFAULT_IMAGE_LIMITS.max_pixels,
                      metavar="N", help="largest image, width times height (413 beyond it, "
                                        f"read from the header; default "
                                        f"{DEFAULT_IMAGE_LIMITS.max_pixels})")
    http.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="DOMAIN",
                      help="domains image URLs may name; flare fetches no remote image, so "
                           "such URLs are still refused, saying fetching is not supported")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="model ids clients may send, the first one reported (default: "
                           "the model directory's name)")
    http.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                      help="largest accepted request body; larger ones get 413")
    http.add_argument("--parse-workers", type=int, default=DEFAULT_PARSE_WORKERS,
                      help="processes that check bodies of 64 KiB or more before they are "
                           "prepared, off the serving process (0: a thread of the serving "
                           f"process; default {DEFAULT_PARSE_WORKERS})")
    http.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                      help="seconds in-flight requests may finish after SIGINT/SIGTERM")
    http.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                      help="seconds an idle connection stays open (before its first request "
                           f"and between requests; default {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})")
    http.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S,
                      help="seconds a client may leave a write untaken before its connection "
                           "is closed and its request cancelled "
                           f"(default {DEFAULT_WRITE_TIMEOUT_S:g})")
    http.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                      help="connections served at once; beyond it a connection gets 503 "
                           f"(default {DEFAULT_MAX_CONNECTIONS})")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-format", choices=LOG_FORMATS, default="console")
    logs.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                      default="info")
    add_vllm_arguments(parser)


def mixed_prefill(flag: bool | None, speculation: SpeculationSetting) -> bool:
    """Whether ``flare run`` prepares mixed programs: ``--mixed-prefill`` or
    ``--no-mixed-prefill`` when given, else on for a load without speculation. A prompt
    then joins the running decode batch instead of waiting for a prefill frame of its own
    to outprice it (docs/benchmarks.md, *Against another server*); speculative loads keep
    them opt-in (their mixed programs triple the catalog and skip image features)."""
    return flag if flag is not None else speculation == "off"


def build_runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    speculation: SpeculationSetting = args.speculation or (
        "adaptive" if args.draft_model is not None or args.draft_source == "copy" else "off")
    return RuntimeConfig(
        model_dir=model_dir(args),
        draft_model_dir=args.draft_model,
        logprobs_mode=args.logprobs_mode,
        dtype=args.dtype,
        **engine_config(args), nnodes=args.nnodes,
        max_batch=args.max_batch,
        prefill_capacities=prefill_capacities(args),
        mixed_prefill=mixed_prefill(args.mixed_prefill, speculation),
        speculative_mixed=args.speculative_mixed,
        speculation=speculation,
        speculative_token_capacity=args.speculative_token_capacity,
        draft_source=args.draft_source or "draft",
        draft_depth=args.draft_depth,
        copy_counterfactuals=not args.no_copy_counterfactuals,
        draft_counterfactuals=not args.no_draft_counterfactuals,
        draft_catch_up=args.draft_catch_up,
        vision_feature_images=args.vision_feature_images,
        speculative_allocation=args.speculative_allocation,
        max_context=args.max_context,
        kv_pages=args.kv_pages,
        max_queue=args.max_queue, admission_order=args.admission_order,
        prefix_caching=prefix_caching(args), decode_prompt_tail=args.decode_prompt_tail,
        gpu_memory_utilization=args.gpu_memory_utilization,
        scheduler_policy=args.scheduler_policy,
        scheduler_terminal_value=args.scheduler_terminal_value,
        scheduler_terminal_age_price=args.scheduler_terminal_age_price,
        adaptive_verification_alpha=args.mtp_adaptive_verification_alpha,
        cost_drift_weight=args.cost_drift_weight,
    )


def build_app_settings(args: argparse.Namespace) -> AppSettings:
    if args.max_request_bytes < 1024:
        raise ConfigError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if not 0 <= args.parse_workers <= MAX_PARSE_WORKERS:
        raise ConfigError(f"--parse-workers must be between 0 and {MAX_PARSE_WORKERS}, got "
                          f"{args.parse_workers}")
    if not args.shutdown_grace >= 0 or args.shutdown_grace == float("inf"):
        raise ConfigError(f"--shutdown-grace must be finite and >= 0, got {args.shutdown_grace}")
    if args.max_context is not None and args.max_context < 1:
        raise ConfigError(f"--max-context must be positive, got {args.max_context}")
    if args.kv_pages is not None and args.kv_pages < 1:
        raise ConfigError(f"--kv-pages must be positive, got {args.kv_pages}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key must not be empty")
    if args.metrics_require_key and args.api_key is None:
        raise ConfigError("--metrics-require-key needs --api-key (or FLARE_API_KEY)")
    for flag, value in (("--max-image-bytes", args.max_image_bytes),
                        ("--max-image-pixels", args.max_image_pixels)):
        if value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")
    names = tuple(dict.fromkeys(args.served_model_name or ()))
    if any(not name.strip() for name in names):
        raise ConfigError("--served-model-name: names must not be empty")
    return AppSettings(api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                       served_model_name=names[0] if names else None,
                       served_model_aliases=names[1:],
                       chat_template=(None if args.chat_template is None
                                      else load_chat_template(args.chat_template)),
                       allowed_origins=args.allowed_origins,
                       metrics_require_key=args.metrics_require_key,
                       parse_workers=args.parse_workers,
                       image_limits=ImageLimits(
                           max_images=args.limit_mm_per_prompt,
                           max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels,
                           allowed_domains=tuple(d.lower() for d in args.allowed_media_domains)))


def build_connection_settings(args: argparse.Namespace) -> ConnectionSettings:
    for flag, value in (("--keep-alive-timeout", args.keep_alive_timeout),
                        ("--write-timeout", args.write_timeout)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be finite and > 0, got {value}")
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections must be positive, got {args.max_connections}")
    return ConnectionSettings(keep_alive_timeout_s=args.keep_alive_timeout,
                              write_timeout_s=args.write_timeout,
                              max_connections=args.max_connections)


def main(args: argparse.Namespace) -> int:
    """Check everything that can be checked, bind the port, then prepare and serve.

    Every start-up failure is one line and exit status 2 (``ops.startup_checks``)."""
    try:
        config, settings, connections = prepare_startup(args)
    except (StartupError, *STARTUP_FAILURES) as exc:
        return report_failure(str(exc), log_format=args.log_format)
    try:  # before preparing: a port in use is known in milliseconds, not minutes
        listener = bind_listener(args.host, args.port)
    except OSError as exc:
        return report_failure(f"--port {args.port}: cannot listen on {args.host}:{args.port}: "
                              f"{exc.strerror or exc}", log_format=args.log_format)
    configure_logging(args.log_format, level=args.log_level)
    quiet_request_logs(args.disable_log_requests)
    try:
        status = trio.run(partial(serve_until_signalled, open_runtime, config, settings,
                                  host=args.host, port=args.port, grace_s=args.shutdown_grace,
                                  connections=connections, listener=listener))
    except BaseException as exc:
        # Once the server took the socket over, start-up is over: anything later is no
        # start-up failure and keeps its traceback.
        cause = startup_cause(exc) if listener.fileno() != -1 else None
        if cause is None:
            raise
        return report_failure(str(cause), log_format=args.log_format)
    finally:
        if listener.fileno() != -1:  # never handed to the server
            listener.close()
    return int(status or 0)


def quiet_request_logs(quiet: bool) -> None:
    """``--disable-log-requests``: no per-request info records (``request.admitted``,
    ``request.first_token``, ``request.finished``...); failures are still logged."""
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.WARNING if quiet else logging.NOTSET)


def prepare_startup(args: argparse.Namespace
                    ) -> tuple[RuntimeConfig, AppSettings, ConnectionSettings]:
    """The runtime, HTTP and connection settings of ``args``, once every value, the
    model directories, the device and the chat template are known to be usable.

    Raises ``ConfigError``, ``StartupError`` or ``ChatTemplateError`` naming the cause."""
    config = build_runtime_config(args)
    config.validate()
    settings = build_app_settings(args)
    connections = build_connection_settings(args)
    check_model_dir(config.model_dir, flag="--model")
    if config.draft_model_dir is not None:
        check_model_dir(config.draft_model_dir, flag="--draft-model", needs_tokenizer=False)
    check_backend(config.backend)
    return config, settings, connections


async def serve_until_signalled(open_runtime: OpenRuntime, config: RuntimeConfig,
                                settings: AppSettings, *, host: str, port: int, grace_s: float,
                                connections: ConnectionSettings | None = None,
                                listener: socket.socket | None = None,
                                task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED
                                ) -> int:
    """Prepare the runtime, serve until SIGINT/SIGTERM, then drain and close.

    Returns the exit status: 0 after a graceful stop, ``128 + signal`` (130 for SIGINT,
    143 for SIGTERM) after a forced one. A second signal while draining ends every open
    request at once (streams get an error event) and then closes as a graceful stop does;
    a signal during preparation, or a third one, cancels outright. ``listener``: the
    socket ``bind_listener`` bound before preparation (else ``host:port`` is bound when
    the runtime is ready). Signals arrive through
    trio's signal receiver, so no ``KeyboardInterrupt`` is ever raised in worker threads
    and the runtime always closes its device threads before the process exits.
    """
    stop_requested = trio.Event()
    forced: list[int] = []
    handle: ServerHandle | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if handle is not None and not stop_requested.is_set():
                        log.info("server.signal", signal=name, action="graceful shutdown",
                                 grace_s=grace_s)
                        stop_requested.set()
                        continue
                    forced.append(FORCED_EXIT_BASE + signum)
                    if handle is not None and len(forced) == 1:
                        log.warning("server.signal", signal=name, action="end requests now",
                                    in_flight=len(handle.service.inflight))
                        handle.service.inflight.abort_all(FORCED_STOP_MESSAGE)
                    else:
                        log.warning("server.signal", signal=name, action="stop now")
                        nursery.cancel_scope.cancel()

            nursery.start_soon(watch_signals)
            log.info("runtime.preparing", model=str(config.model_dir), backend=config.backend,
                     max_batch=config.max_batch, prefill_capacities=list(config.prefill_capacities),
                     speculation=config.speculation, admission_order=config.admission_order)
            started = time.monotonic()
            async with open_runtime(config) as runtime:
                log.info("runtime.prepared", model=runtime.model_name,
                         max_context=runtime.max_context,
                         seconds=round(time.monotonic() - started, 3))
                app = create_app(runtime, settings)
                async with trio.open_nursery() as http:
                    handle = await http.start(partial(serve_http, app, host=host, port=port,
                                                      connections=connections,
                                                      listener=listener))
                    log.info("server.ready", address=handle.url, model=handle.service.model_name,
                             api_key_required=settings.api_key is not None)
                    task_status.started(handle)
                    await stop_requested.wait()
                    await handle.shutdown(grace_s)
            nursery.cancel_scope.cancel()
    status = forced[0] if forced else 0
    log.info("server.stopped", exit_status=status)
    return status
