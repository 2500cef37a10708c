"""Qwen3's real chat template, as the xinference package ships it on PyPI (its model registry holds each
family's Hugging Face template), fetched once into the test cache."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from conftest import cache_dir

REQUIREMENT = "xinference==4.1.0"
MEMBER = "xinference/model/llm/models/qwen3.json"


def qwen3_chat_template() -> str:
    target = cache_dir() / "qwen3-chat-template.jinja"
    if not target.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", REQUIREMENT, "-d", tmp], check=True)
            with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as zf:
                (family,) = json.loads(zf.read(MEMBER))
        if family["model_name"] != "qwen3" or "<tool_call>" not in family["chat_template"]:
            raise RuntimeError(f"{MEMBER} in {REQUIREMENT} does not hold Qwen3's tool-calling template")
        target.write_text(family["chat_template"], encoding="utf-8")
    return target.read_text(encoding="utf-8")
