"""Where a command will write its results, checked before it runs: a long benchmark that fails to write its JSON at
the end has lost its results."""

from __future__ import annotations

import os
from pathlib import Path


def unwritable_file(option: str, path: Path) -> str | None:
    """Why ``path`` cannot take a file that ``option`` names (its folder made where missing), else None."""
    if path.is_dir():
        return f"{option} {path}: is a folder; name a file"
    return unwritable_folder(option, path.parent, of=path)


def unwritable_folder(option: str, folder: Path, of: Path | None = None) -> str | None:
    """Why files cannot be written into ``folder`` (made where missing), else None; ``of``: the path named."""
    named = of if of is not None else folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{option} {named}: cannot make its folder {folder}: {exc.strerror or exc}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{option} {named}: cannot write into {folder}"
    return None
