"""A page rendered by a real browser: headless Chromium (Debian's `chromium`, which
scripts/install-test-deps.sh installs), its console messages and a screenshot."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support.test_deps import wait_for_test_deps


def chromium() -> str:
    wait_for_test_deps()  # installed in the background while the suite starts
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "no chromium (scripts/install-test-deps.sh installs it as root: apt-get install chromium)"
        )
    return found


def render(page: Path, screenshot: Path) -> list[str]:
    """Render `page` (1100 px wide) into `screenshot`; -> the console's messages (an error a script on the
    page logged, a resource that did not load)."""
    result = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1100,2600",
            f"--screenshot={screenshot}",
            Path(page).resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert screenshot.is_file(), result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if "CONSOLE" in line]


def plot_pixels(screenshot: Path) -> float:
    """The fraction of the screenshot in matplotlib's first two line colours (C0 blue, C1 orange): zero on
    a blank page or one whose plots did not load."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(screenshot).convert("RGB"), dtype=np.int32)
    near = [np.abs(pixels - colour).sum(axis=-1) < 60 for colour in ((31, 119, 180), (255, 127, 14))]
    return float((near[0] | near[1]).mean())
