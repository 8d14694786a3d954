"""The playground page in a real headless browser (Debian's chromium driven by playwright's bundled driver).

Checks that a chat streams in, that accepted-draft tokens are highlighted (DOM and pixels of a screenshot),
and that the compare toggle runs plain decoding beside it with the same text.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from serving import running
from test_server import build_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make setup installs it as root)")

DRAFT_RGB = (0xBB, 0xF7, 0xD0)  # --draft in playground.html
# The tiny random model greedily repeats the prompt's last token; with the test chat template that token is
# "\n" (invisible). A bare template makes it " fox": visible text that prompt lookup drafts and gets accepted.
BARE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def page_url():
    _, app = build_app(chat_template=BARE_TEMPLATE)
    with running(app) as url:
        yield url


def test_playground_highlights_drafted_tokens(page_url, tmp_path: Path):
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.goto(page_url)
        page.wait_for_function("document.querySelectorAll('#drafter option').length >= 3")
        page.select_option("#drafter", "ngram")
        page.fill("#prompt", "The quick brown fox")
        page.fill("#max-tokens", "60")
        page.check("#compare")
        page.click("#send")
        page.wait_for_selector("#speedup", timeout=60_000)
        assert page.inner_text("#error") == ""
        drafted = page.locator("#out-spec .tok-draft").count()
        assert drafted > 5  # the tiny model repeats itself, so prompt lookup gets accepted
        assert "fox fox" in page.inner_text("#out-spec")
        assert page.locator("#out-plain .tok-draft").count() == 0  # plain decoding drafts nothing
        spec_text = page.eval_on_selector(
            "#out-spec", "e => [...e.querySelectorAll('span')].map(s => s.textContent).join('')"
        )
        plain_text = page.eval_on_selector(
            "#out-plain", "e => [...e.querySelectorAll('span')].map(s => s.textContent).join('')"
        )
        assert spec_text == plain_text  # greedy: the block-parallel answer is the plain answer
        tau = float(page.inner_text("#stats-spec .tau"))
        assert tau > 1.0
        spec_shot, plain_shot = tmp_path / "spec.png", tmp_path / "plain.png"
        page.locator("#out-spec").screenshot(path=str(spec_shot))
        page.locator("#out-plain").screenshot(path=str(plain_shot))
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        browser.close()

    def draft_pixels(path: Path) -> int:
        img = Image.open(io.BytesIO(path.read_bytes())).convert("RGB")
        return sum(1 for px in img.getdata() if px == DRAFT_RGB)

    assert draft_pixels(spec_shot) > 500  # highlighted tokens are on screen in the answer, not only in the DOM
    assert draft_pixels(plain_shot) == 0
