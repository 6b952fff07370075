"""The viewer page's files, read once from the package (no CDN: the page works offline)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

#: What the page is made of, and how each is served.
FILES = {
    "index.html": "text/html",
    "viewer.css": "text/css",
    "viewer.js": "text/javascript",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str


def load_assets() -> dict[str, Asset]:
    """Every file of ``static/`` (blocking file reads: call it off the event loop)."""
    folder = resources.files("rollout_proxy.ui") / "static"
    return {name: Asset((folder / name).read_bytes(), content_type) for name, content_type in FILES.items()}
