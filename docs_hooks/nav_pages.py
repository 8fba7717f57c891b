"""MkDocs hook: a guide or benchmark page that mkdocs.yml's nav does not list joins it.

Pages under docs/guides/ and docs/benchmarks/ are written by whoever builds the
feature they describe; a page left out of the nav would be unreachable (and
`mkdocs build --strict` fails on it). At build time each such page is appended
to its section (Guides or Benchmarks), titled by its first `# ` heading, so a
new page is in the site as soon as it is in the tree; list it in mkdocs.yml to
choose its place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SECTIONS = {"guides": "Guides", "benchmarks": "Benchmarks"}


def _listed(nav: Any) -> set[str]:
    """Every page path the nav names, at any depth."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_listed(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_listed(value) for value in nav.values())) if nav else set()
    return set()


def _title(page: Path) -> str:
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem.replace("-", " ").capitalize()


def unlisted_pages(docs_dir: Path, nav: list[Any]) -> dict[str, list[tuple[str, str]]]:
    """Per section title: (title, path) of the section folder's pages the nav lacks."""
    listed = _listed(nav)
    found: dict[str, list[tuple[str, str]]] = {}
    for folder, section in SECTIONS.items():
        for page in sorted((docs_dir / folder).glob("*.md")):
            path = page.relative_to(docs_dir).as_posix()
            if path not in listed:
                found.setdefault(section, []).append((_title(page), path))
    return found


def on_config(config: Any) -> Any:
    nav = config["nav"]
    if not nav:
        return config
    for section, pages in unlisted_pages(Path(config["docs_dir"]), nav).items():
        for item in nav:
            if isinstance(item, dict) and section in item:
                item[section].extend({title: path} for title, path in pages)
                break
    return config
