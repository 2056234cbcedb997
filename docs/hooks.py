"""MkDocs hook: the configuration page's reference is generated from the config dataclasses.

`docs/configuration.md` holds the prose and a `<!-- config-reference -->` marker; at build time
the marker becomes `distflow.config.reference.reference_markdown()` (a table per section: every
key, its type, default and attribute docstring), so the site always lists the keys the code has.
"""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "<!-- config-reference -->"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # a clone without `pip install -e .`


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from distflow.config.reference import reference_markdown

    return markdown.replace(MARKER, reference_markdown())
