"""Headless Chromium for the report's tests: the page as a browser loads it, offline."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = next((shutil.which(name) for name in ("chromium-headless-shell", "chromium", "chromium-browser") if shutil.which(name)), None)
WINDOW = (1100, 1400)  # the window the findings table ran off


def _chromium(page: Path, *action: str) -> subprocess.CompletedProcess:
    """Chromium on the page, offline (a page needing the network would show it), in a WINDOW-sized window."""
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--hide-scrollbars",
         "--proxy-server=127.0.0.1:9", "--virtual-time-budget=5000", f"--window-size={WINDOW[0]},{WINDOW[1]}",
         *action, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


def open_in_chromium(page: Path) -> str:
    """The document after Chromium loaded it."""
    return _chromium(page, "--dump-dom").stdout


def screenshot(page: Path, path: Path):
    """What the first WINDOW of the page looks like, as RGB pixels."""
    from PIL import Image

    _chromium(page, f"--screenshot={path}")
    return Image.open(path).convert("RGB")


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (.ci/run installs chromium-headless-shell from Debian)")
