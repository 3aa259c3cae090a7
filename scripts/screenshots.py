"""Screenshots of the playground (after a decision) and the status page at 1280 and 375 px, for the README.

Run from the repository root: ``.venv/bin/python -m scripts.screenshots`` (a tiny-model server and Debian's
chromium, as the browser tests use). Writes ``docs/screenshots/*.png``, reduced to 256 colours to stay small.
"""

from __future__ import annotations

import io
from pathlib import Path

from devtools.browser import chromium_browser, tiny_server
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

OUT = REPO / "docs" / "screenshots"
WIDTHS = {"desktop": 1280, "phone": 375}


def save(png: bytes, path: Path) -> None:
    """Write a screenshot as a 256-colour PNG (a fraction of the size, no visible loss for flat UI)."""
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, format="PNG", optimize=True)
    print(f"{path.relative_to(REPO)}: {image.width}x{image.height}, {path.stat().st_size // 1024} KiB")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tiny_server() as server, chromium_browser() as browser:
        for label, width in WIDTHS.items():
            context = browser.new_context(viewport={"width": width, "height": 900}, device_scale_factor=1)
            context.set_default_timeout(120_000)
            page = context.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("body[data-ready='true']")
            page.get_by_role("button", name="Load example").click()
            with page.expect_response(lambda r: r.url.endswith("/v1/systemone")):
                page.get_by_role("button", name="Decide", exact=True).click()
            page.get_by_role("meter").first.wait_for()
            # One column (phone): show the answers, which come after the editor; two: the top of the page.
            page.evaluate(
                "(phone) => phone ? document.getElementById('answers-heading').scrollIntoView()"
                " : window.scrollTo(0, 0)",
                width < 600,
            )
            save(page.screenshot(), OUT / f"playground-{label}.png")
            page.goto(server.url + "/status")
            page.wait_for_function("document.getElementById('s-p50').textContent.endsWith('ms')")
            save(page.screenshot(full_page=True), OUT / f"status-{label}.png")
            context.close()


if __name__ == "__main__":
    main()
