"""`strata`: the MCP tools as terminal commands, for a person (same functions, same results)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from strata_mcp.runtime import DEFAULT_MODEL, USER_ERRORS, Runtime
from strata_mcp.tooling import Reporter, ToolSpec, parse_args
from strata_mcp.http.serving import LOCALHOST, check_binding, serve
from strata_mcp.tools import benchmark, chat, check_pc, choose_model, connect_info, install, logs, start, status, stop

QUICKSTART_QUESTION = "What is the capital of France?"


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
    result = call(runtime, check_pc.SPEC)
    show(result, args.json, _pc_details(result))


def cmd_choose(runtime: Runtime, args) -> None:
    result = call(runtime, choose_model.SPEC, goal=args.goal, context_length=args.context, ram_gb=args.ram_gb, vram_gb=args.vram_gb)
    show(result, args.json, _choice_details(result))


def cmd_install(runtime: Runtime, args) -> None:
    if args.cancel:
        show(call(runtime, install.SPEC, model=args.model, cancel=True), args.json)
        return
    plan = call(runtime, install.SPEC, model=args.model)
    show(plan, args.json)
    if plan.plan.already_installed:
        return
    if not args.yes:
        if not sys.stdin.isatty() or input("Download it now? [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing downloaded (pass --yes to skip this question).")
            return
    show(call(runtime, install.SPEC, model=args.model, confirm=True, wait_seconds=24 * 3600), args.json)


def _start(runtime: Runtime, model: str | None, device: str, as_json: bool) -> None:
    result = call(runtime, start.SPEC, model=model, device=device, wait_seconds=3600)
    show(result, as_json)
    if result.engine.state != "ready":
        raise SystemExit(1)


def cmd_chat(runtime: Runtime, args) -> None:
    _start(runtime, args.model, args.device, args.json)
    result = call(runtime, chat.SPEC, prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.json:
        show(result, True)
    else:
        print(result.text)
        print(f"  [{result.summary}]")


def cmd_status(runtime: Runtime, args) -> None:
    result = call(runtime, status.SPEC)
    show(result, args.json, [f"installed: {m.id} ({m.size_bytes / 1e6:.0f} MB)" for m in result.installed]
         + [f"install: {j.model_id} {j.state}" for j in result.installs] + [f"data folder: {result.data_dir}"])


def cmd_serve(runtime: Runtime, args) -> None:
    """Load the model, serve it over HTTP and keep serving until Ctrl+C."""
    api_key = args.api_key or os.environ.get("STRATA_API_KEY") or None
    check_binding(args.host, api_key)  # before a long load, not after
    _start(runtime, args.model, args.device, args.json)
    server = serve(runtime, args.host, args.port, api_key)
    info = call(runtime, connect_info.SPEC)
    show(info, args.json, [] if args.json else [f"{app}:\n    " + text.replace("\n", "\n    ")
                                                for app, text in info.examples.items()])
    print("Serving; press Ctrl+C to stop.", file=sys.stderr)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def cmd_logs(runtime: Runtime, args) -> None:
    result = call(runtime, logs.SPEC, lines=args.lines)
    if args.json:
        show(result, True)
    else:
        print("\n".join(result.lines) if result.lines else result.summary)


def cmd_bench(runtime: Runtime, args) -> None:
    _start(runtime, args.model, args.device, args.json)
    show(call(runtime, benchmark.SPEC, max_tokens=args.max_tokens), args.json)


def cmd_quickstart(runtime: Runtime, args) -> None:
    """The whole chain on the embedded model, each step printed as the MCP tools return it."""
    steps = [
        ("check_pc", lambda: call(runtime, check_pc.SPEC)),
        ("choose_model", lambda: call(runtime, choose_model.SPEC)),
        ("install (plan)", lambda: call(runtime, install.SPEC, model=DEFAULT_MODEL)),
        ("install", lambda: call(runtime, install.SPEC, model=DEFAULT_MODEL, confirm=True, wait_seconds=3600)),
        ("start", lambda: call(runtime, start.SPEC, model=DEFAULT_MODEL, device=args.device, wait_seconds=3600)),
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
        if name == "install" and result.action != "installed":
            raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Run a local language model on this PC.")
    parser.add_argument("--data-dir", type=Path, default=None, help="Model folder (default: STRATA_DATA_DIR or the user data folder).")
    parser.add_argument("--json", action="store_true", help="Print the full structured result.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("check", help="What this PC has, and a verdict.").set_defaults(func=cmd_check)

    p = sub.add_parser("choose", help="The best model for this PC.")
    p.add_argument("--goal", choices=["code", "chat", "speed", "quality"], default="chat")
    p.add_argument("--context", type=int, default=None, help="Context length in tokens.")
    p.add_argument("--ram-gb", type=float, default=None, help="Override detected RAM.")
    p.add_argument("--vram-gb", type=float, default=None, help="Override detected VRAM.")
    p.set_defaults(func=cmd_choose)

    p = sub.add_parser("install", help="Download and verify a model (shows the plan first).")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--yes", action="store_true", help="Do not ask before downloading.")
    p.add_argument("--cancel", action="store_true", help="Stop a running install (keeps partial bytes).")
    p.set_defaults(func=cmd_install)

    p = sub.add_parser("chat", help="Load a model and answer one prompt.")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_chat)

    sub.add_parser("status", help="Installed models and installs.").set_defaults(func=cmd_status)

    p = sub.add_parser("serve", help="Load a model and serve it to other apps (OpenAI- and Anthropic-compatible HTTP).")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--host", default=LOCALHOST, help="Address to listen on; anything but loopback needs --api-key.")
    p.add_argument("--port", type=int, default=None, help="Default: the port used last time, else a free one.")
    p.add_argument("--api-key", default=None, help="Key every request must carry (default: STRATA_API_KEY).")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("logs", help="The last lines of the server's log.")
    p.add_argument("--lines", type=int, default=50)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("bench", help="Load a model and measure its prompt and output tokens/s.")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("quickstart", help="Check, choose, install, start, chat, status, stop on the embedded model.")
    p.add_argument("--question", default=QUICKSTART_QUESTION)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.set_defaults(func=cmd_quickstart)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    runtime = Runtime(args.data_dir)
    try:
        args.func(runtime, args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if runtime.slot.state != "stopped":
            runtime.stop_model(force=True)


if __name__ == "__main__":
    main()
