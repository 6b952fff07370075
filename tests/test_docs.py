"""The docs: the site builds strictly and offline, the architecture page's layout is the package's, and the
README stays short and links only to what exists.

``mkdocs build --strict`` fails on a broken link or anchor, a page left out of the nav, a docstring
mkdocstrings cannot render, or a generated part (``scripts/docs_hooks.py``) that fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "rollout_proxy"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(config),
        "--site-dir",
        str(site),
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-6000:]
    return out


def test_the_site_builds_strictly_with_every_page(site: Path):
    for page in sorted(DOCS.rglob("*.md")):
        relative = page.relative_to(DOCS).with_suffix("")
        folder = relative.parent if relative.name == "index" else relative
        assert (site / folder / "index.html").exists(), f"{page.relative_to(ROOT)} was not built"


def test_the_api_reference_and_the_generated_parts_are_rendered(site: Path):
    sdk = (site / "reference" / "sdk" / "index.html").read_text()
    for name in ("RolloutInferenceProxy", "InferenceProxy", "test_with_dataset", "rollout", "GroupGraderResult"):
        assert f'id="rollout_proxy.sdk.{name}"' in sdk, name
    wire = (site / "reference" / "wire" / "index.html").read_text()
    assert 'id="rollout_proxy.wire.Trajectory"' in wire and "total_token_ids" in wire
    trainer = (site / "reference" / "trainer" / "index.html").read_text()
    assert 'id="rollout_proxy.trainer.TrajectoryConsumer"' in trainer and "FeedGroup" in trainer
    settings = (site / "settings" / "index.html").read_text()
    assert "--engine-backoff-max" in settings and "<!-- generated" not in settings
    runner = (site / "runner" / "index.html").read_text()
    assert "ROLLOUT_PROXY_RUN_STORE" in runner and "<!-- generated" not in runner
    training = (site / "training" / "index.html").read_text()
    assert "ROLLOUT_PROXY_TRAINER_KEEP_WEIGHTS" in training and "<!-- generated" not in training
    metrics = (site / "metrics" / "index.html").read_text()
    assert "rollout_proxy_turns_total" in metrics and "rollout_proxy_prompt_drift_total" in metrics


def test_the_site_loads_nothing_from_outside(site: Path):
    """Offline: no web font, script or stylesheet from another host (search and the theme are local)."""
    outside = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""")
    found = []
    for page in sorted(site.rglob("*.html")):
        found += [f"{page.relative_to(site)}: {match.group(0)}" for match in outside.finditer(page.read_text())]
    for sheet in sorted(site.rglob("*.css")):
        if re.search(r"@import\s+url\(\s*['\"]?https?:|fonts\.googleapis", sheet.read_text()):
            found.append(str(sheet.relative_to(site)))
    assert found == []


def test_a_broken_link_fails_the_strict_build(tmp_path: Path):
    """The same validation settings on a two-page site: a link to a missing page is an error, not a warning."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[a page](other.md), [gone](missing.md)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    small = {
        "site_name": "check",
        "docs_dir": str(tmp_path / "docs"),
        "strict": True,
        "validation": config["validation"],
        "nav": ["index.md", "other.md"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    build = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert build.returncode != 0
    assert "missing.md" in build.stderr


def layout_block() -> str:
    page = (DOCS / "architecture.md").read_text()
    section = page.split("## Layout", 1)[1]
    return section.split("```text\n", 1)[1].split("```", 1)[0]


def test_the_architecture_page_names_every_subpackage_and_nothing_else():
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    named = set(re.findall(r"^  (\w+)/", layout_block(), re.MULTILINE))
    assert named == subpackages, f"not on the page: {sorted(subpackages - named)}; gone: {sorted(named - subpackages)}"
    nested = {path.parent.relative_to(PACKAGE) for path in PACKAGE.glob("*/*/__init__.py")}
    block = layout_block()
    missing = [str(path) for path in sorted(nested) if f"{path.name}/" not in block]
    assert missing == [], f"nested packages the layout does not name: {missing}"


def test_the_modules_the_architecture_page_names_exist():
    named = set(re.findall(r"\b(\w+)\.py\b", layout_block()))
    files = {path.stem for path in PACKAGE.rglob("*.py")}
    for tree in ("bench", "devtools", "tests"):
        files |= {path.stem for path in (ROOT / tree).rglob("*.py")}
    assert named - files == set()


def test_the_readme_is_short_and_links_only_to_what_exists():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links its docs pages"
    assert [link for link in local if not (ROOT / link).exists()] == []
    assert not re.search(r"/(?:work|root|home|tmp)/", readme), "no path of the machine the README was written on"


def test_every_docs_page_the_readme_lists_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(docs/([^)#]+\.md)", readme):
        assert f": {link}" in nav, link
