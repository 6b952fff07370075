"""A command harness for the tests, as a small agent would be written: the openai SDK against the session.

A planner subagent first (a conversation of its own), then the coder: the task, the plan and the files;
it writes the file its answer names, runs the test, and tells the coder what the test said (a second turn
of the coder's conversation; ``FIX_AGENT_TURNS=1``: not). The session's URL and key come from
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import openai

task = sys.argv[1]
client = openai.OpenAI(max_retries=0)


def ask(messages: list[dict[str, str]]) -> str:
    return client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""


plan = ask([{"role": "system", "content": "You plan bug fixes."}, {"role": "user", "content": f"Plan: {task}"}])
files = sorted(pathlib.Path(".").glob("*.py"))
listing = "\n\n".join(f"{path.name}:\n```python\n{path.read_text()}```" for path in files)
coder = [
    {"role": "system", "content": "You fix bugs. Answer FILE: <name>, then the whole file in a python block."},
    {"role": "user", "content": f"{task}\n\nPlan: {plan}\n\n{listing}"},
]
answer = ask(coder)
found = re.search(r"FILE: (\S+)\n```python\n(.*?)```", answer, re.DOTALL)
if found:
    pathlib.Path(found.group(1)).write_text(found.group(2))
tests = [str(path.name) for path in files if path.name.startswith("test_")]
ran = subprocess.run([sys.executable, *tests[:1]], capture_output=True, text=True, check=False)
if os.environ.get("FIX_AGENT_TURNS") == "1":
    print(f"the test exited {ran.returncode}")
    sys.exit(0)
coder += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"The test exited {ran.returncode}."}]
print(ask(coder))
