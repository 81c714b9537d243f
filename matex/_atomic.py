"""Files that readers see whole or not at all: written beside, then renamed into place.

Every file another process may read while it is written (status and flight
records, probes, search results, plots) goes through here: the data goes to a
temporary file in the same directory, named for this process, which then
replaces the target in one ``rename``. A reader finds the old file or the new
one, never half of one; a writer that fails leaves the old file and no litter.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mkdir: bool = False) -> Iterator[str]:
    """Yield a temporary path to write; on leaving the block it replaces ``path``.

    The temporary file sits in ``path``'s directory (so the rename is atomic) and
    keeps its extension (so writers that go by it, such as matplotlib, still
    can). ``mkdir``: make the directory first. An error in the block removes the
    temporary file and leaves ``path`` as it was.
    """
    path = os.fspath(path)
    directory, name = os.path.split(path)
    if mkdir and directory:
        os.makedirs(directory, exist_ok=True)
    stem, ext = os.path.splitext(name)
    tmp = os.path.join(directory, ".%s.%d.incoming%s" % (stem, os.getpid(), ext))
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write(path: str | os.PathLike, data: str | bytes, mkdir: bool = False) -> str:
    """Write ``data`` (text or bytes) to ``path`` atomically (see ``replacing``);
    returns the path."""
    with replacing(path, mkdir=mkdir) as tmp:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    return os.fspath(path)
