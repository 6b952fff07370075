"""A scripted policy for the fake engine that plays a shell-tool agent (the Codex demo on ``--engine fake``).

It reads the prompt it was given (the chat template's text): after a tool result it answers with what the
command printed; otherwise it calls the harness's shell tool to ``cat`` the file the task names. Replies are
in the hermes tool-call format the proxy parses, with a ``<think>`` block (Codex echoes reasoning back).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable

from devtools.fake_engine import FakeEngine

#: the shell tool each harness gives the model, and its argument
SHELL_TOOLS = (("exec_command", "cmd"), ("shell", "command"), ("bash", "command"))
_FILE = re.compile(r"[\w./-]+\.txt")


def _last_turn(text: str) -> str:
    start = text.rfind("<|im_start|>user\n")
    return text[start:] if start >= 0 else text


def _printed(tool_output: str) -> str:
    """What the command printed: Codex wraps it (``Output:\\n...``); other harnesses send it as it is."""
    output = tool_output.split("Output:\n", 1)[-1]
    with contextlib.suppress(ValueError, AttributeError):  # mini-swe-agent's: a JSON object with "output"
        output = str(json.loads(output).get("output", output))
    return output.strip().splitlines()[0] if output.strip() else ""


def shell_agent(engine: FakeEngine) -> Callable[[list[int]], str]:
    """The policy: ``engine.policy = shell_agent(engine)``."""

    def policy(prompt_ids: list[int]) -> str:
        text = engine.decode(prompt_ids)
        turn = _last_turn(text)
        if "<tool_response>" in turn:
            result = turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
            return f"<think>\nThe command printed the file.\n</think>\n\nThe file says: {_printed(result)}"
        tool, argument = next(((name, arg) for name, arg in SHELL_TOOLS if f'"name": "{name}"' in text), SHELL_TOOLS[0])
        names = _FILE.findall(turn)
        command = f"cat {names[-1]}" if names else "ls"
        call = json.dumps({"name": tool, "arguments": {argument: command}})
        return f"<think>\nI should read the file first.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"

    return policy


def swe_agent(engine: FakeEngine, solutions: dict[str, dict[str, str]]) -> Callable[[list[int]], str]:
    """A policy for the SWE-style job (``examples/swe_job.yaml``): ``solutions`` maps each task to its fixed files.

    The odd asks of a task write the fix with the harness's shell tool, the even ones only run the test, so
    the rollouts of a task disagree (a learning signal); after a tool result it says it is done. A prompt asked
    again (a harness retrying a slow request) gets the answer it got the first time, so retries do not shift
    which rollouts fix the bug."""
    asked: dict[str, int] = {}
    answered: dict[str, bool] = {}

    def policy(prompt_ids: list[int]) -> str:
        text = engine.decode(prompt_ids)
        if "<tool_response>" in _last_turn(text):
            return "<think>\nThe command ran.\n</think>\n\nDone."
        task = next((task for task in solutions if task in text), None)
        tool, argument = next(((name, arg) for name, arg in SHELL_TOOLS if f'"name": "{name}"' in text), SHELL_TOOLS[0])
        if task is None:
            command = "ls"
        else:
            if text not in answered:
                asked[task] = asked.get(task, 0) + 1
                answered[text] = bool(asked[task] % 2)
            files = solutions[task]
            if answered[text]:
                command = "".join(f"cat > {name} <<'EOF'\n{body}EOF\n" for name, body in files.items())
            else:
                command = "python3 " + " ".join(f"test_{name}" for name in files)
        call = json.dumps({"name": tool, "arguments": {argument: command}})
        return f"<think>\nI should change the code, then run the test.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"

    return policy
