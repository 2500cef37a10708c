"""`strata`: the MCP tools as terminal commands, for a person (same functions, same results)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from strata_mcp.http.serving import LOCALHOST, check_binding, serve
from strata_mcp.runtime import DEFAULT_MODEL, USER_ERRORS, Runtime, open_runtime
from strata_mcp.tooling import Reporter, ToolSpec, failure_sentence, parse_args
from strata_mcp.tools import benchmark, chat, check_pc, choose_model, connect_info, install, logs, start, status, stop

QUICKSTART_QUESTION = "What is the capital of France?"
# The CLI follows installs and loads to the end, one tool call after another, so how long one call waits is its own.
FOLLOWED = ("wait_seconds",)


class TerminalProgress:
    """One self-overwriting progress line on stderr, at most a few updates a second."""

    def __init__(self) -> None:
        self._last = 0.0
        self._shown = False

    def __call__(self, done: float, total: float | None, message: str) -> None:
        now = time.monotonic()
        if now - self._last < 0.2 or not sys.stderr.isatty():
            return
        self._last = now
        line = message.replace("\n", " ")[:100]
        sys.stderr.write(f"\r\033[K  {line}")
        sys.stderr.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._shown = False


def _option_kind(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field's type; the model itself still checks the value."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if annotation is bool:
        return {"action": "store_true"}
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation))}
    if annotation in (int, float, str):
        return {"type": annotation}
    if get_origin(annotation) is list and get_args(annotation) == (str,):
        return {"action": "append", "metavar": "TEXT"}
    return {"type": json.loads, "metavar": "JSON"}


def add_options(parser: argparse.ArgumentParser, spec: ToolSpec, skip: tuple[str, ...] = ()) -> None:
    """One option per field of the tool's input model, as the MCP schema has one property per field. An option
    left out is left out of the call too, so the tool's own default applies."""
    for name, field in spec.input_model.model_fields.items():
        if name not in skip:
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS,
                                help=field.description, **_option_kind(field.annotation))


def given(args: argparse.Namespace, spec: ToolSpec, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The options of `spec` that were given on the command line."""
    return {name: getattr(args, name) for name in spec.input_model.model_fields if name not in skip and hasattr(args, name)}


def call(runtime: Runtime, spec: ToolSpec, **raw: Any) -> BaseModel:
    progress = TerminalProgress()
    try:
        return spec.run(runtime, parse_args(spec, raw), Reporter(progress))
    finally:
        progress.clear()


def show(result: BaseModel, as_json: bool, details: list[str] = ()) -> None:
    if as_json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
        return
    print(result.summary)  # type: ignore[attr-defined]
    for line in details:
        print(f"  {line}")


def _pc_details(result: check_pc.CheckPcOutput) -> list[str]:
    pc = result.pc
    lines = [f"{pc.os.name} {pc.os.version}; {pc.cpu.model}; RAM {pc.ram_total_bytes / 2**30:.1f} GiB"]
    lines += [f"GPU: {g.name}, {g.vram_total_bytes / 2**30:.1f} GiB" for g in pc.gpus]
    return lines + [f"- {r}" for r in pc.reasons]


def _choice_details(rec) -> list[str]:
    lines = []
    if rec.choice is not None:
        lines.append(f"pick: {rec.choice.model_id} - {rec.choice.why}")
    lines += [f"also fits: {a.model_id} - {a.why}" for a in rec.alternatives[:3]]
    lines += [f"does not fit: {r.id} - {r.reason}" for r in rec.not_fitting[:3]]
    return lines


def cmd_check(runtime: Runtime, args) -> None:
    result = call(runtime, check_pc.SPEC, **given(args, check_pc.SPEC))
    show(result, args.json, _pc_details(result))


def cmd_choose(runtime: Runtime, args) -> None:
    result = call(runtime, choose_model.SPEC, **given(args, choose_model.SPEC))
    show(result, args.json, _choice_details(result))


def _install(runtime: Runtime, model: str, **options: Any) -> install.InstallOutput:
    """Confirm the install and follow it, one tool call per wait, until it is no longer running."""
    result = call(runtime, install.SPEC, model=model, confirm=True, **options)
    while result.action == "installing":
        result = call(runtime, install.SPEC, model=model, confirm=True, **options)
    return result


def cmd_install(runtime: Runtime, args) -> None:
    options = given(args, install.SPEC, skip=("model",))
    if options.pop("cancel", False):
        show(call(runtime, install.SPEC, model=args.model, cancel=True), args.json)
        return
    plan = call(runtime, install.SPEC, model=args.model, **options)
    show(plan, args.json)
    if plan.plan.already_installed:
        return
    if not args.yes:
        if not sys.stdin.isatty() or input("Download it now? [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing downloaded (pass --yes to skip this question).")
            return
    result = _install(runtime, args.model, **options)
    show(result, args.json)
    if result.action != "installed":
        raise SystemExit(1)


def _start(runtime: Runtime, **options: Any) -> start.StartOutput:
    """Start the model and follow its load (start again reports the same load) until it is no longer loading."""
    result = call(runtime, start.SPEC, **options)
    while result.engine.state == "loading":
        result = call(runtime, start.SPEC, **options)
    return result


def _load(runtime: Runtime, args, skip: tuple[str, ...] = (), announce: bool = False) -> None:
    """Start the model the command's start options name and follow the load; exit unless it is ready. announce:
    print the start result when it is ready too."""
    started = _start(runtime, **given(args, start.SPEC, skip=skip))
    if announce or started.engine.state != "ready":
        show(started, args.json)
    if started.engine.state != "ready":
        raise SystemExit(1)


def cmd_chat(runtime: Runtime, args) -> None:
    _load(runtime, args)
    result = call(runtime, chat.SPEC, **given(args, chat.SPEC))
    if args.json:
        show(result, True)
    else:
        print(result.text)
        print(f"  [{result.summary}]")


def cmd_status(runtime: Runtime, args) -> None:
    result = call(runtime, status.SPEC, **given(args, status.SPEC))
    show(result, args.json, [f"installed: {m.id} ({m.size_bytes / 1e6:.0f} MB)" for m in result.installed]
         + [f"install: {j.model_id} {j.state}" for j in result.installs] + [f"data folder: {result.data_dir}"])


def cmd_serve(runtime: Runtime, args) -> None:
    """Load the model, serve it over HTTP and keep serving until Ctrl+C."""
    api_key = args.api_key or os.environ.get("STRATA_API_KEY") or None
    check_binding(args.host, api_key)  # before a long load, not after
    # Ctrl+C is how serving ends, even when started from a shell's background job, which starts us with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _load(runtime, args, skip=("port",), announce=True)
    server = serve(runtime, args.host, getattr(args, "port", None), api_key)
    try:  # from here on Ctrl+C is how serving ends, even before the address is shown
        info = call(runtime, connect_info.SPEC)
        show(info, args.json, [] if args.json else [f"{app}:\n    " + text.replace("\n", "\n    ")
                                                    for app, text in info.examples.items()])
        sys.stdout.flush()  # a program reading our output through a pipe sees the address now, not at exit
        print("Serving; press Ctrl+C to stop.", file=sys.stderr)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def cmd_logs(runtime: Runtime, args) -> None:
    result = call(runtime, logs.SPEC, **given(args, logs.SPEC))
    if args.json:
        show(result, True)
    else:
        print("\n".join(result.lines) if result.lines else result.summary)


def cmd_bench(runtime: Runtime, args) -> None:
    _load(runtime, args, announce=True)
    show(call(runtime, benchmark.SPEC, **given(args, benchmark.SPEC)), args.json)


def cmd_quickstart(runtime: Runtime, args) -> None:
    """The whole chain on the embedded model, each step printed as the MCP tools return it."""
    steps = [
        ("check_pc", lambda: call(runtime, check_pc.SPEC)),
        ("choose_model", lambda: call(runtime, choose_model.SPEC)),
        ("install (plan)", lambda: call(runtime, install.SPEC, model=DEFAULT_MODEL)),
        ("install", lambda: _install(runtime, DEFAULT_MODEL)),
        ("start", lambda: _start(runtime, model=DEFAULT_MODEL, device=args.device)),
        ("chat", lambda: call(runtime, chat.SPEC, prompt=args.question, temperature=0, max_tokens=64)),
        ("status", lambda: call(runtime, status.SPEC)),
        ("stop", lambda: call(runtime, stop.SPEC)),
    ]
    for number, (name, step) in enumerate(steps, 1):
        result = step()
        print(f"[{number}/{len(steps)}] {name}: {result.summary}")
        if name == "choose_model" and result.choice is not None and result.choice.model_id != DEFAULT_MODEL:
            print(f"      (quickstart goes on with the embedded {DEFAULT_MODEL}; `strata install {result.choice.model_id}` gets the pick)")
        if name == "chat":
            print(f"      Q: {args.question}\n      A: {result.text.strip()}")
        if (name == "install" and result.action != "installed") or (name == "start" and result.engine.state != "ready"):
            raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Run a local language model on this PC.")
    parser.add_argument("--data-dir", type=Path, default=None, help="Model folder (default: STRATA_DATA_DIR or the user data folder).")
    parser.add_argument("--json", action="store_true", help="Print the full structured result.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="What this PC has, and a verdict.")
    add_options(p, check_pc.SPEC)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("choose", help="The best model for this PC.")
    add_options(p, choose_model.SPEC)
    p.set_defaults(func=cmd_choose)

    p = sub.add_parser("install", help="Download and verify a model (shows the plan first).")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--yes", action="store_true", help="Do not ask before downloading.")
    add_options(p, install.SPEC, skip=FOLLOWED + ("model", "confirm"))
    p.set_defaults(func=cmd_install)

    p = sub.add_parser("chat", help="Load a model and answer one prompt (or --messages).")
    p.add_argument("prompt", nargs="?", default=argparse.SUPPRESS)
    add_options(p, start.SPEC, skip=FOLLOWED + ("serve", "port"))
    add_options(p, chat.SPEC, skip=("prompt",))
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("status", help="Installed models and installs.")
    add_options(p, status.SPEC)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("serve", help="Load a model and serve it to other apps (OpenAI- and Anthropic-compatible HTTP).")
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS)
    add_options(p, start.SPEC, skip=FOLLOWED + ("model", "serve"))
    p.add_argument("--host", default=LOCALHOST, help="Address to listen on; anything but loopback needs --api-key.")
    p.add_argument("--api-key", default=None, help="Key every request must carry (default: STRATA_API_KEY).")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("logs", help="The last lines of the server's log.")
    add_options(p, logs.SPEC)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("bench", help="Load a model and measure its prompt and output tokens/s.")
    p.add_argument("model", nargs="?", default=argparse.SUPPRESS)
    add_options(p, start.SPEC, skip=FOLLOWED + ("model", "serve", "port"))
    add_options(p, benchmark.SPEC)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("quickstart", help="Check, choose, install, start, chat, status, stop on the embedded model.")
    p.add_argument("--question", default=QUICKSTART_QUESTION)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.set_defaults(func=cmd_quickstart)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    runtime = None
    try:
        runtime = open_runtime(args.data_dir)
        args.func(runtime, args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:  # a bug: one sentence for the person, as the MCP tools give
        print(f"error: {failure_sentence(args.command, exc)}", file=sys.stderr)
        raise SystemExit(3) from None
    finally:
        if runtime is not None and runtime.slot.state != "stopped":
            runtime.stop_model(force=True)


if __name__ == "__main__":
    main()
