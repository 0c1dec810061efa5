"""How a long pass says where it is, front-end neutral: `stage(text)` logs it (logger `normpass.progress`,
level INFO, silent unless someone listens: the CLI's `Heartbeat` prints the latest every few seconds where
no progress bar shows), and `progress(items, ...)` iterates with a stage per item and, when asked, a bar.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from typing import TypeVar

LOGGER_NAME = "normpass.progress"
_logger = logging.getLogger(LOGGER_NAME)
Item = TypeVar("Item")


def stage(text: str) -> None:
    """Say what the pass is doing now."""
    _logger.info(text)


def progress(items: Sequence[Item], description: str, enabled: bool) -> Iterator[Item]:
    """`items`, each reported as a stage (`description: batch i/n`), with a progress bar on stderr (tqdm when
    installed) when `enabled`."""
    shown = _bar(items, description) if enabled else items
    for index, item in enumerate(shown):
        stage(f"{description}: batch {index + 1}/{len(items)}")
        yield item


def _bar(items: Sequence[Item], description: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is usually there
        return _plain_bar(items, description)
    return tqdm(items, desc=description, unit="batch", leave=False, file=sys.stderr)


def _plain_bar(items: Sequence[Item], description: str) -> Iterator[Item]:
    for index, item in enumerate(items):
        print(f"\r{description}: batch {index + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)
