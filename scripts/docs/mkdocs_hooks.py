"""MkDocs hook (mkdocs.yml's ``hooks:``): the site's home page and its contributing page are the
repository's README.md and CONTRIBUTING.md, read at build time so that each has one source.

Those two files link to pages as ``docs/NAME.md`` (right on a repository host); on the site the
pages sit beside them, so the links are rewritten before MkDocs checks them (``--strict`` then
fails on any that does not resolve, as on every other page)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# docs/ page -> the repository file whose text it shows; the page itself holds only a pointer.
MIRRORED = {"index.md": "README.md", "contributing.md": "CONTRIBUTING.md"}
# Links between the two mirrored files, as seen from docs/.
_RENAMED = {"README.md": "index.md", "CONTRIBUTING.md": "contributing.md"}


def site_text(text: str) -> str:
    """The repository-root Markdown ``text`` with its links made relative to docs/."""

    def target(match: re.Match[str]) -> str:
        link = match.group(1)
        path, sep, anchor = link.partition("#")
        if path.startswith("docs/"):
            path = path[len("docs/") :]
        else:
            path = _RENAMED.get(path, path)
        return f"]({path}{sep}{anchor})"

    return re.sub(r"\]\(([^)\s]+)\)", target, text)


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    source = MIRRORED.get(page.file.src_uri)
    if source is None:
        return markdown
    root = Path(config["config_file_path"]).parent
    return site_text((root / source).read_text(encoding="utf-8"))
