"""MkDocs hooks: the pages that are generated rather than written.

- The home page is the repository's README.md (its links into docs/ made relative to the site),
  so the front page on GitHub and on the site are one text.
- `docs/configuration.md` holds prose and a `<!-- config-reference -->` marker; at build time the
  marker becomes `distflow.config.reference.reference_markdown()` (a table per section: every key,
  its type, default and attribute docstring), so the site lists exactly the keys the code has.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- config-reference -->"
sys.path.insert(0, str(REPO / "src"))  # a clone without `pip install -e .`


def home_page(readme: str) -> str:
    """README.md as the site's index.md: `docs/x.md` links become `x.md`."""
    return readme.replace("](docs/", "](")


def on_files(files, config):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=home_page(readme)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from distflow.config.reference import reference_markdown

    return markdown.replace(MARKER, reference_markdown())
