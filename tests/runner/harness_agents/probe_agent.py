"""A command harness for the tests that records what it was given (its environment, HOME, the directory it
runs in) into ``probe.json`` in its working directory, makes one model call, then behaves as ``argv[1]``
says: ``ok``, ``fail`` (a message on stderr, exit 3), or ``hang`` (sleeps; it started a child of its own
before the call, and both pids went to ``$PIDS_FILE`` with the working directory at once)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

mode = sys.argv[1]
probe = {"env": dict(os.environ), "home": str(pathlib.Path.home()), "cwd": os.getcwd(), "argv": sys.argv[1:]}
probe["home_entries"] = sorted(entry.name for entry in pathlib.Path.home().iterdir())
pathlib.Path("probe.json").write_text(json.dumps(probe))
if mode == "hang":  # at once: a 1 s timeout on a loaded machine must not kill it before its pids are written
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    with open(os.environ["PIDS_FILE"], "a") as pids:
        pids.write(json.dumps({"pid": os.getpid(), "child": child.pid, "cwd": os.getcwd()}) + "\n")

import openai  # noqa: E402 (after the pids: its import alone can take a loaded machine's second)

client = openai.OpenAI(max_retries=0)
reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Say something."}])
print(f"the policy said: {reply.choices[0].message.content}", flush=True)
if mode == "fail":
    print("boom: the agent gave up", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(1000)
