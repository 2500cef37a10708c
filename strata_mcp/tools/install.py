"""install: a plan first; with confirm, a resumable, verified background download."""

from __future__ import annotations

import time
from typing import Literal

from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from setup_logic.install import FINISHED, Installer, InstallPlan, InstallProgress
from strata_mcp.runtime import DEFAULT_MODEL, Runtime
from strata_mcp.tooling import Reporter, ToolInput, ToolSpec


class InstallInput(ToolInput):
    model: str = Field(DEFAULT_MODEL, description="Catalog id from choose_model.")
    confirm: bool = Field(False, description="false: only show the plan (nothing is written). true: download and verify.")
    cancel: bool = Field(False, description="Stop a running install; its partial bytes are kept for a later resume.")
    verify: bool = Field(
        False,
        description="With confirm, for a model already installed: hash every file again in full (sha256) and download "
        "again any that changed. Without it, an installed model gets the quick check (size, date, sampled blocks).",
    )
    wait_seconds: float = Field(
        30.0, ge=0, le=3600,
        description="With confirm: how long to wait (reporting progress) before returning; the download goes on in the background.",
    )


class InstallOutput(BaseModel):
    summary: str
    model: str
    action: Literal["plan", "cancelled", "installing", "installed", "failed", "idle"] = Field(
        description="idle: cancel found no install of this model running and the model is not installed.")
    plan: InstallPlan | None = None
    progress: InstallProgress | None = None


def _describe(progress: InstallProgress) -> str:
    if progress.state == "installed":
        checked = "verified" if progress.verified is not False else "unverified (no sha256 is published for it)"
        return f"{progress.model_id} is installed and {checked}; next: start."
    if progress.state == "failed":
        return f"Install of {progress.model_id} failed: {progress.error}"
    if progress.state == "cancelled":
        return f"Install of {progress.model_id} cancelled; partial bytes are kept, install again with confirm=true to resume."
    pct = 100 * progress.bytes_done / progress.bytes_total if progress.bytes_total else 0.0
    eta = f", about {progress.eta_seconds:.0f} s left" if progress.eta_seconds is not None else ""
    stalled = " (stalled: no bytes arriving)" if progress.stalled else ""
    return (
        f"Installing {progress.model_id}: {progress.state} {pct:.0f}% of {progress.bytes_total / 1e6:.0f} MB{eta}{stalled}; "
        "call install again with confirm=true to see progress."
    )


def _action(progress: InstallProgress) -> str:
    return {"installed": "installed", "failed": "failed", "cancelled": "cancelled"}.get(progress.state, "installing")


def _cancel(installer: Installer, model: str) -> InstallOutput:
    progress = installer.progress(model)
    if progress is not None and progress.state not in FINISHED:
        progress = installer.cancel(model)
        if progress.state == "cancelled":
            return InstallOutput(summary=_describe(progress), model=model, action="cancelled", progress=progress)
    nothing = f"No install of {model} is running, so nothing was cancelled"
    if installer.is_installed(model):
        return InstallOutput(summary=f"{nothing}; {model} is installed; next: start.", model=model,
                             action="installed", progress=progress)
    if progress is not None:
        return InstallOutput(summary=f"{nothing}; its last install ended {progress.state}.", model=model,
                             action=_action(progress), progress=progress)
    return InstallOutput(summary=f"{nothing}; call install with confirm=true to start one.", model=model,
                         action="idle")


def run(runtime: Runtime, args: InstallInput, reporter: Reporter) -> InstallOutput:
    installer = runtime.installer
    if args.cancel:
        return _cancel(installer, args.model)
    if not args.confirm:
        plan = installer.plan(args.model)
        return InstallOutput(summary=plan.summary, model=args.model, action="plan", plan=plan)

    progress = installer.start(args.model, verify=args.verify)
    deadline = time.monotonic() + args.wait_seconds
    while progress.state in ("queued", "downloading", "verifying") and time.monotonic() < deadline:
        if reporter.cancelled():
            progress = installer.cancel(args.model)
            break
        progress = installer.wait(args.model, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        reporter.progress(progress.bytes_done, progress.bytes_total or None, _describe(progress))
    return InstallOutput(summary=_describe(progress), model=args.model, action=_action(progress), progress=progress)


SPEC = ToolSpec(
    name="install",
    title="Install a model",
    description=(
        "Download a model into the data folder. Without confirm it returns the plan (bytes, free disk, "
        "whether it fits) and writes nothing; show it to the person. With confirm=true it starts a "
        "background download of the hub commit the plan names (resumable; size and sha256 verified before the "
        "model counts as installed, or marked unverified where no sha256 is published), reports progress for up "
        "to wait_seconds, and returns; call again with confirm=true to follow it, or cancel=true to stop it "
        "(partial bytes are kept, so a later confirm resumes). For an installed model, confirm=true checks its "
        "files again (verify=true: in full) and downloads again any that changed."
    ),
    input_model=InstallInput,
    output_model=InstallOutput,
    run=run,
    annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True, openWorldHint=True),
)
