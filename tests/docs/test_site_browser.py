"""The built site, looked at in headless Chromium.

Skipped unless ``KERAS_LONGATTN_SITE_URL`` points at the served site
(``scripts/extra_stages.sh`` builds it, serves ``site/`` on 127.0.0.1 and
sets it). For each page: Chromium renders it (``--dump-dom``) and the
expected headings must be in the rendered DOM; a screenshot
(``--screenshot``, 1280x900) must not be blank. Screenshots are kept in
``$KERAS_LONGATTN_SCREENSHOT_DIR`` (default ``build/site-screenshots``).

Chromium: ``$KERAS_LONGATTN_CHROMIUM``, else ``chromium`` (Debian's package),
``chromium-browser`` or ``google-chrome`` on PATH.
"""

import html
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

SITE_URL = os.environ.get("KERAS_LONGATTN_SITE_URL", "").rstrip("/")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not SITE_URL,
    reason="set KERAS_LONGATTN_SITE_URL to the served site (scripts/extra_stages.sh does)",
)

#: (name, path, headings that must be rendered, other text that must be there)
PAGES = [
    ("home", "", ["keras_longattn", "Mechanisms", "Where to go next"], []),
    ("api-layers", "api/layers/",
     ["Layers", "keras_longattn.layers.LocalAttention", "keras_longattn.layers.FullAttention"],
     []),
    ("quickstart", "notebooks/quickstart/",
     ["Quick start", "Loss curve", "Validation bits per byte", "Sampling", "Checks"],
     ["All claims hold at this scale.", "data:image/png;base64,"]),
    ("guide-local", "guides/local_attention/", ["LocalAttention", "Pattern", "Cost"],
     ["assets/patterns/local_attention.png"]),
]

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--window-size=1280,900", "--virtual-time-budget=5000",
]


def chromium():
    for candidate in (os.environ.get("KERAS_LONGATTN_CHROMIUM"), "chromium",
                      "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    pytest.fail("no Chromium found: install Debian's `chromium` package or set "
                "KERAS_LONGATTN_CHROMIUM")


def run_chromium(args, profile, timeout=90):
    profile.mkdir(parents=True, exist_ok=True)
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-2000:]}"
    return result.stdout


def headings(dom):
    found = []
    for match in re.finditer(r"<h([1-6])\b[^>]*>(.*?)</h\1>", dom, re.S | re.I):
        text = html.unescape(re.sub(r"<[^>]+>", "", match.group(2)))
        found.append(" ".join(text.replace("¶", "").split()))
    return found


def screenshot_dir():
    directory = Path(os.environ.get("KERAS_LONGATTN_SCREENSHOT_DIR",
                                    ROOT / "build" / "site-screenshots"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def assert_not_blank(png):
    import matplotlib.image as mpimg
    import numpy as np

    image = mpimg.imread(png)[..., :3]
    assert image.shape[0] >= 800 and image.shape[1] >= 1200, image.shape
    assert float(image.std()) > 0.05, f"{png}: almost uniform (std {image.std():.4f})"
    colours, counts = np.unique(
        (image * 255).astype("uint8").reshape(-1, 3), axis=0, return_counts=True)
    assert counts.max() / counts.sum() < 0.97, f"{png}: one colour covers the page"
    assert len(colours) > 50, f"{png}: only {len(colours)} colours"


@pytest.mark.parametrize("name,path,expected,texts", PAGES, ids=[p[0] for p in PAGES])
def test_page_renders(name, path, expected, texts, tmp_path):
    url = f"{SITE_URL}/{path}"
    dom = run_chromium(["--dump-dom", url], tmp_path / "dom-profile")
    found = headings(dom)
    for heading in expected:
        assert any(heading in h for h in found), f"{url}: no heading {heading!r} in {found}"
    for text in texts:
        assert text in dom, f"{url}: {text!r} not in the rendered page"
    # Offline: no script or stylesheet from another host.
    scripts = re.findall(r"<script\b[^>]*\bsrc=\"([^\"]*)\"", dom)
    styles = [
        re.search(r"\bhref=\"([^\"]*)\"", tag).group(1)
        for tag in re.findall(r"<link\b[^>]*>", dom)
        if re.search(r"\brel=\"?stylesheet", tag) and re.search(r"\bhref=\"", tag)
    ]
    external = [u for u in scripts + styles
                if re.match(r"(https?:)?//", u) and not u.startswith(SITE_URL)]
    assert not external, f"{url} loads from other hosts: {external}"

    png = screenshot_dir() / f"{name}.png"
    if png.exists():
        png.unlink()
    run_chromium([f"--screenshot={png}", url], tmp_path / "shot-profile")
    assert png.is_file(), f"Chromium wrote no screenshot of {url}"
    assert_not_blank(png)


def test_pattern_figures_are_served():
    for layer in ("full_attention", "local_attention"):
        with urllib.request.urlopen(f"{SITE_URL}/assets/patterns/{layer}.png", timeout=10) as r:
            data = r.read()
        assert r.status == 200 and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
