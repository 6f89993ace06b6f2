"""The documentation site as a reader meets it: built from the repository with warnings as errors (`make docs-build`),
served over HTTP and opened in a real headless Chromium (Debian's `chromium` and `chromium-driver`, through
Selenium): every page loads, every internal link and anchor resolves, every figure renders, nothing is fetched from
another host, and the generated pages hold what they are generated from."""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

# What a page reports about itself, read in the browser once it has loaded.
PAGE_STATE = """
return {
  title: document.title,
  ids: Array.from(document.querySelectorAll('[id]'), e => e.id),
  links: Array.from(document.querySelectorAll('a[href]'), a => a.href),
  images: Array.from(document.images, i => ({src: i.src, complete: i.complete, width: i.naturalWidth})),
  assets: Array.from(document.querySelectorAll('script[src], link[href][rel~="stylesheet"], img[src]'),
                     e => e.src || e.href),
  mermaid: Array.from(document.querySelectorAll('.mermaid'), e => e.querySelector('svg') !== null),
  text: document.body.innerText,
};
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as `make docs-build` builds it (strict: a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    command = [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)})  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return out


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[webdriver.Chrome]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(
            "the site's browser test needs Debian's chromium and chromium-driver: apt-get install -y chromium "
            "chromium-driver (.ci/run installs them)",
            pytrace=False,
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def crawl(browser: webdriver.Chrome, root: str) -> dict[str, dict]:
    """Every page under `root` reachable from its index by links, each loaded in the browser: its state."""
    pages: dict[str, dict] = {}
    queue = [root + "index.html"]
    while queue:
        url = queue.pop()
        if url in pages:
            continue
        browser.get(url)
        pages[url] = state = browser.execute_script(PAGE_STATE)
        for link in state["links"]:
            target, _ = urldefrag(link)
            if target.startswith(root) and target.endswith(".html") and target not in pages:
                queue.append(target)
    return pages


@pytest.fixture(scope="module")
def pages(browser, server) -> dict[str, dict]:
    return crawl(browser, server)


def test_every_page_of_the_site_is_reached_and_loads(site, server, pages):
    built = {server + path.relative_to(site).as_posix() for path in site.rglob("*.html")} - {server + "404.html"}
    assert built - set(pages) == set(), "pages no link leads to"
    for url, state in pages.items():
        assert status(url) == 200, url
        assert state["title"] and "404" not in state["title"] and state["text"].strip(), url


def test_every_internal_link_and_anchor_resolves(server, pages):
    broken = []
    for url, state in pages.items():
        for link in state["links"]:
            target, anchor = urldefrag(link)
            if not target.startswith(server):
                continue
            if target in pages:
                if anchor and anchor not in pages[target]["ids"]:
                    broken.append(f"{url} -> {link} (no such anchor)")
            elif status(target) != 200:
                broken.append(f"{url} -> {link}")
    assert broken == []


def test_every_figure_renders_and_nothing_comes_from_another_host(server, pages):
    figures = 0
    for url, state in pages.items():
        for image in state["images"]:
            assert image["complete"] and image["width"] > 0, f"{url}: {image['src']} does not render"
            figures += 1
        assert all(state["mermaid"]), f"{url}: a mermaid diagram did not render"
        outside = [asset for asset in state["assets"] if urlparse(asset).netloc != urlparse(server).netloc]
        assert outside == [], f"{url} loads assets from another host (the site must work offline)"
    assert figures >= 6  # the concepts' figures, the benchmarks' plots and the default job's loss


def test_the_generated_pages_hold_what_they_are_generated_from(server, pages):
    import dataclasses

    from hf_diloco import DiLoCoConfig

    configuration = pages[server + "reference/configuration.html"]["text"]
    for field in dataclasses.fields(DiLoCoConfig):
        words = " ".join(field.metadata["help"].replace("`", "").split()[:5])
        assert field.name in configuration and words in configuration, field.name
    api = pages[server + "reference/api.html"]["text"]
    for name in ("DiLoCoTrainer", "DiLoCoTrainingArguments", "DiLoCoPlugin", "DiLoCo", "TorchftMembership"):
        assert name in api
    assert "{{" not in "".join(state["text"] for state in pages.values()), "a figure placeholder left unfilled"
    assert "Loss parity" in pages[server + "benchmarks.html"]["text"]  # BENCHMARKS.md, included


def test_links_that_leave_for_the_repository_are_rewritten(site):
    """design.md links to ../BENCHMARKS.md for the repository's readers; on the site it is the benchmarks page."""
    hrefs = [part.split('"', 1)[0] for part in (site / "design.html").read_text().split('href="')[1:]]
    assert "benchmarks.html#a-joiner-with-other-settings" in hrefs
    assert not [href for href in hrefs if "BENCHMARKS.md" in href]
