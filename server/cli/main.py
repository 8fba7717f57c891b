"""The `flashserve` command: serve, chat, import-gguf, prepare, bench.

Every setting of server/settings.py is also a flag of `serve` and `chat`
(`--resident-layers 4`), so there is one list of knobs, not two.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from flashserve.server.settings import Settings, SettingsError, load_settings

log = logging.getLogger("flashserve")

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # bench options belong to engine.bench; everything it doesn't know is passed on.
    args, rest = parser.parse_known_args(argv)
    if rest and getattr(args, "command", None) != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except (SettingsError, _UserError) as exc:
        print(f"flashserve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


class _UserError(Exception):
    """A problem the user can fix; shown as one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashserve", description=__doc__)
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    _add_settings_flags(serve)
    serve.set_defaults(run=_serve)

    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    _add_settings_flags(chat)
    chat.set_defaults(run=_chat)

    imp = sub.add_parser("import-gguf", help="convert a GGUF file to an mlx-lm model directory")
    imp.add_argument("file", type=Path)
    imp.add_argument("out_dir", type=Path)
    imp.add_argument("--force", action="store_true", help="overwrite a non-empty OUT_DIR")
    imp.set_defaults(run=_import_gguf)

    prep = sub.add_parser("prepare", help="write the streaming layout of a model")
    prep.add_argument("model", help="model dir, GGUF file, or 'default'")
    prep.add_argument("out", type=Path)
    prep.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8), help="re-quantize layers")
    prep.add_argument("--expert-bits", type=int, choices=(2, 3, 4, 5, 6, 8))
    prep.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    prep.add_argument("--force", action="store_true", help="overwrite a non-empty OUT")
    prep.set_defaults(run=_prepare)

    bench = sub.add_parser(
        "bench", help="measure tokens/s and memory; prints tables", add_help=False
    )
    bench.add_argument("--config", help="config.toml (default: ./config.toml if present)")
    bench.add_argument("--blas", choices=get_args(Settings.model_fields["blas"].annotation))
    bench.set_defaults(run=_bench)
    return parser


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config.toml (default: ./config.toml if present)")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action="store_true", default=None, help=field.description)
        else:
            choices = get_args(field.annotation) if _is_literal(field.annotation) else None
            parser.add_argument(flag, default=None, choices=choices, help=field.description)


def _is_literal(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is not None and str(annotation).startswith(
        "typing.Literal"
    )


def _settings(args: argparse.Namespace) -> Settings:
    cli = {name: getattr(args, name, None) for name in Settings.model_fields}
    settings = load_settings(args.config, **cli)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _select_blas(settings.blas)
    return settings


def _select_blas(choice: str) -> None:
    """Before anything imports mlx: the BLAS is bound when libmlx loads (engine/compute/blas.py)."""
    from flashserve.engine.compute import blas

    try:
        log.debug("float matmuls: %s BLAS", blas.select(choice))  # type: ignore[arg-type]
    except blas.BlasError as exc:
        raise _UserError(str(exc)) from None


def _check_model(settings: Settings) -> None:
    from flashserve.engine.weights.model import ModelLoadError
    from flashserve.engine.weights.sources import resolve

    if settings.several_models and settings.model is None:
        settings.model_entries()  # the catalog's own checks (names, tables, models_dir)
        return
    try:
        resolve(settings.model)
    except ModelLoadError as exc:
        raise _UserError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _check_model(settings)
    from flashserve.engine.distributed import group

    if settings.hostfile and not group.launched_as_rank():
        return _launch_ranks(settings, args.argv)
    if group.launched_as_rank() and group.env_rank() != 0:
        return _follow(settings)

    # Importing mlx_lm.utils sets the open-file limits to (2048, 4096); ours come after.
    import mlx_lm.utils  # noqa: F401

    from flashserve.engine.generation.worker import Engine
    from flashserve.server.app import create_app
    from flashserve.server.http.connections import fit_open_file_limit
    from flashserve.server.http.lifecycle import make_server

    # The --model loads at start (models_dir alone: each model on its first request).
    entries, default = settings.model_entries()
    engine = Engine(next(e.config for e in entries if e.name == default)) if default else None
    app = create_app(settings, engine)
    # Graceful shutdown (drain generations on SIGTERM and SIGINT, exit 0), the access
    # log, and connections bounded (idle ones closed) within the open-file limit.
    server = make_server(
        app,
        settings.host,
        settings.port,
        settings.log_level,
        settings.shutdown_grace,
        max_connections=fit_open_file_limit(settings.max_connections),
        keep_alive_timeout=settings.keep_alive_timeout,
    )

    def stop_if_load_fails() -> None:
        assert engine is not None
        engine.wait_ready()
        if engine.state == "failed":
            server.should_exit = True

    if engine is not None:
        threading.Thread(target=stop_if_load_fails, daemon=True).start()
    server.run()
    if engine is not None and engine.state == "failed":
        # One line, no traceback: exit code 2 tells service managers not to restart
        # (systemd's RestartPreventExitStatus=2); a broken model will not load later.
        reason = " ".join(str(engine.load_error).split())
        print(f"flashserve: the model failed to load: {reason}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _launch_ranks(settings: Settings, argv: list[str]) -> int:
    """`serve --hostfile`: every rank runs this same command through mlx.launch."""
    import signal
    import subprocess

    from flashserve.engine.distributed.launch import HostfileError, launch_command

    serve_args, skip = [], False
    for arg in argv[argv.index("serve") + 1 :]:
        if skip or arg.startswith("--hostfile="):
            skip = False
            continue
        skip = arg == "--hostfile"
        if not skip:
            serve_args.append(arg)
    try:
        cmd = launch_command(
            settings.hostfile,  # type: ignore[arg-type]
            serve_args,
            backend=settings.distributed_backend,
            port=settings.distributed_port,
        )
    except HostfileError as exc:
        raise _UserError(str(exc)) from None
    log.info("starting the ranks: %s", " ".join(cmd))
    # Its own session: a signal to this process reaches every local rank once,
    # as SIGTERM (rank 0 drains; the other ranks stop when rank 0 has).
    # No stdin: the ranks take no input (launch.py's launcher does not read it).
    launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return launcher.wait()


def _follow(settings: Settings) -> int:
    """A rank other than 0: no HTTP; follow rank 0's steps until it stops."""
    import signal

    from flashserve.engine.distributed import follower, node
    from flashserve.engine.weights.model import ModelLoadError

    # Rank 0 decides when to stop (it drains first); this rank ends with it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        this = node.start(settings.engine_config())
    except ModelLoadError as exc:
        reason = " ".join(str(exc).split())
        print(f"flashserve: the model failed to load: {reason}", file=sys.stderr)
        return EXIT_USAGE
    return follower.follow(this)


def _chat(args: argparse.Namespace) -> int:
    from flashserve.server.cli.chat import run_chat

    settings = _settings(args)
    _check_model(settings)
    return run_chat(settings)


def _import_gguf(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from flashserve.engine.weights.gguf.model import import_gguf

    if not args.file.is_file():
        raise _UserError(f"{args.file}: no such file")
    try:
        out = import_gguf(args.file, args.out_dir, force=args.force)
    except (ValueError, FileExistsError) as exc:
        raise _UserError(str(exc)) from None
    log.info("wrote %s", out)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from flashserve.engine.weights.model import ModelLoadError
    from flashserve.engine.weights.prepare import PrepareError, prepare

    spec = None if args.model == "default" else args.model
    try:
        prepare(
            spec,
            args.out,
            bits=args.bits,
            expert_bits=args.expert_bits,
            group_size=args.group_size,
            force=args.force,
        )
    except (PrepareError, ModelLoadError, FileExistsError, ValueError) as exc:
        raise _UserError(str(exc)) from None
    return 0


def _bench(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _select_blas(load_settings(args.config, blas=args.blas).blas)
    from flashserve.engine.bench import runner as bench

    return bench.main([a for a in args.rest if a != "--"])


def run() -> None:
    """Console entry point: main(), then leave without C++ static destructors.

    MLX state left by the worker thread can make the interpreter's normal exit
    abort ("terminate called without an active exception", seen intermittently
    after any model call on a non-main thread), which would turn a clean exit
    into SIGABRT. Everything of ours is already closed by then (the engine shut
    down, the routing trace flushed), so flush Python's own buffers and exit.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
