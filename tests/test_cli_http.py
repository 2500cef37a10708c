"""`strata serve`, `strata logs` and `strata bench` as a person runs them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from strata_mcp import cli

pytestmark = pytest.mark.slow


def strata_command() -> str:
    found = shutil.which("strata", path=str(Path(sys.executable).parent)) or shutil.which("strata")
    assert found, "strata is not installed (pip install -e '.[test]')"
    return found


def test_logs_and_bench(installed_data_dir, capsys):
    cli.main(["--data-dir", str(installed_data_dir), "logs"])
    assert "Nothing logged yet" in capsys.readouterr().out
    cli.main(["--data-dir", str(installed_data_dir), "bench", "--device", "cpu", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert "16 tokens at" in out and "tokens/s" in out
    cli.main(["--data-dir", str(installed_data_dir), "logs", "--lines", "1"])
    (line,) = capsys.readouterr().out.splitlines()
    assert "benchmark: smollm2-135m-instruct" in line
    cli.main(["--data-dir", str(installed_data_dir), "logs"])
    assert "loaded smollm2-135m-instruct" in capsys.readouterr().out


def test_serve_refuses_an_open_address_without_a_key_before_loading(installed_data_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--data-dir", str(installed_data_dir), "serve", "--host", "0.0.0.0", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "API key" in capsys.readouterr().err
    assert not (installed_data_dir / "logs").exists()  # nothing was loaded


def test_serve_answers_until_interrupted(installed_data_dir):
    env = {k: v for k, v in os.environ.items() if k != "STRATA_API_KEY"}
    process = subprocess.Popen(
        [strata_command(), "--data-dir", str(installed_data_dir), "serve", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        summary = process.stdout.readline()
        assert "is ready" in summary
        summary = process.stdout.readline()
        assert summary.startswith("Serving smollm2-135m-instruct at http://127.0.0.1:")
        base_url = re.search(r"http://127\.0\.0\.1:\d+", summary).group()
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="local", max_retries=0)
        reply = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens >= 1
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
