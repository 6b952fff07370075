"""The benchmark pages are what their committed JSON gives (``python -m bench.pages --check``), and the
generator notices what it should: a hand edit inside a generated block, a JSON replaced without its page
regenerated, a block that names no known table or is left open."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import harness, pages


def test_the_committed_pages_are_what_their_json_gives():
    diffs = pages.check()
    assert diffs == [], "run python -m bench.pages:\n" + "".join(diffs)


def test_every_committed_json_is_on_a_page_and_every_page_json_is_committed():
    committed = {path.name for path in pages.DATA.glob("*.json")}
    assert pages.published() == committed
    assert {"proxy_overhead.json", "fleet_faults.json", "streaming_ttft.json", "workers.json"} <= committed


def test_each_page_says_the_command_and_the_machine():
    for page in pages.pages():
        text = page.read_text()
        for match in pages.BLOCK.finditer(text):
            assert "Measured with `python -m bench." in match["body"], (page.name, match["name"])
            assert " CPUs" in match["body"] and "load average" in match["body"], (page.name, match["name"])


def test_a_changed_measurement_changes_its_page():
    page = pages.PAGES / "streaming_ttft.md"
    report = pages.load("streaming_ttft.json")
    changed = copy.deepcopy(report)
    first = next(iter(changed["phases"].values()))
    first["proxy"]["ttft_p50_ms"] += 1000.0
    text = page.read_text()

    def reading(streaming: dict) -> Callable[[str], dict]:  # the page's other blocks read as published
        return lambda name: streaming if name == "streaming_ttft.json" else pages.load(name)

    assert pages.render(text, reading(report)) == text
    assert pages.render(text, reading(changed)) != text


def test_a_hand_edit_inside_a_block_or_a_replaced_json_fails_the_check(tmp_path: Path):
    root, data = tmp_path / "benchmarks", tmp_path / "bench"
    shutil.copytree(pages.PAGES, root)
    shutil.copytree(pages.DATA, data)
    assert pages.check(root, data) == []
    page = root / "workers.md"
    page.write_text(page.read_text().replace("| 64 |", "| 65 |", 1))
    (diff,) = pages.check(root, data)
    assert "workers.md" in diff and "+| 64 |" in diff
    shutil.copy(pages.PAGES / "workers.md", page)
    report = json.loads((data / "workers.json").read_text())
    report["machine"]["cpus"] = 64
    (data / "workers.json").write_text(json.dumps(report))
    (diff,) = pages.check(root, data)
    assert "64 CPUs" in diff


def test_unknown_or_unclosed_blocks_are_refused():
    with pytest.raises(pages.PageError, match="no table is known"):
        pages.render("<!-- bench: nothing.json -->\n<!-- /bench -->\n", lambda name: {})
    with pytest.raises(pages.PageError, match="not closed"):
        pages.render("<!-- bench: workers.json -->\nleft open\n", lambda name: {})


def test_the_recorded_command_leaves_out_this_machines_paths():
    argv = ["--sizes", "3", "--out", "/tmp/somewhere", "--rounds", "1", "--out=/elsewhere"]
    assert harness.command_line("bench.workers", argv) == "python -m bench.workers --sizes 3 --rounds 1"


def test_rotated_puts_every_target_first_in_turn():
    assert [harness.rotated(["a", "b", "c"], index) for index in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert harness.rotated([], 3) == []
