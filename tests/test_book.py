"""The course's website (`make book`), built and then read in a real browser.

`make book` renders the site from the notebooks' stored outputs into a throwaway
folder; a local web server (loopback only) serves it, and headless Chromium opens
every lesson and exercise page, the index and the About pages. Each page's figures
must be images that loaded, no link to another part of the site may be broken, and
no exercise page may hold a line of its solution. Screenshots are kept in
tests/artefacts/book/ (their paths are printed).

Chromium and Playwright as for tests/test_browser.py (its flags, its "skip unless
CI requires it"); Sphinx and MyST-NB come with the `book` extra (`make book-setup`).
With PCOURSE_REQUIRE_BOOK=1 (.ci/run sets it) a missing piece fails instead of skipping.
"""

from __future__ import annotations

import functools
import html as htmllib
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import urldefrag

import nbformat
import pytest
from test_browser import CHROMIUM, CHROMIUM_ARGS, ENABLE, _unavailable

from pcourse.tools.book import build as book_build
from pcourse.tools.workshop import course

REPO = Path(__file__).resolve().parents[1]
ARTEFACTS = REPO / "tests" / "artefacts" / "book"
LESSONS = [e.name for e in course.entries("notebooks")]
EXERCISES = [e.name for e in course.entries("exercises")]
MAKE_TIMEOUT = 900  # s for `make book`, a pip check of the venv included; a bound on a hang
# Lessons whose stored notebook has a plotting cell without its image (the build names
# them too). Another change re-executes these notebooks; drop an entry once it lands.
KNOWN_MISSING_FIGURES: dict[str, str] = {}


def _solution_lines(name: str) -> set[str]:
    return book_build.solution_lines(
        nbformat.read(REPO / "solutions" / f"{name}.ipynb", as_version=4))


# ---------------------------------------------------------------- no browser, no build

def test_a_lesson_page_repeats_the_readmes_two_commands():
    readme = (REPO / "README.md").read_text()
    commands = book_build.two_commands(readme)
    assert commands in readme and "make lab" in commands and "make test" in commands
    entry = course.entries("notebooks")[5]
    note = book_build.run_note(entry, commands)
    assert commands in note and entry.path.as_posix() in note
    with pytest.raises(book_build.BookError, match="The two commands"):
        book_build.two_commands(readme.replace("## The two commands", "## Two commands"))


def test_links_to_files_the_site_lacks_become_repository_paths():
    files = {"index.ipynb", "notebooks/05_franke.ipynb", "INSTRUCTORS.md"}
    text = ("[05](notebooks/05_franke.ipynb) [sol](solutions/01_partitioner.ipynb) "
            "[g](INSTRUCTORS.md#troubleshooting) [web](https://example.org/x.ipynb) [a](#top) "
            "![fig](img.png)")
    out = book_build.rewrite_links(text, PurePosixPath("index.ipynb"), files)
    assert "[05](notebooks/05_franke.ipynb)" in out
    assert "sol (`solutions/01_partitioner.ipynb` in the repository)" in out
    assert "[g](INSTRUCTORS.md#troubleshooting)" in out and "[a](#top)" in out
    assert "[web](https://example.org/x.ipynb)" in out and "![fig](img.png)" in out
    up = book_build.rewrite_links("[i](../INSTRUCTORS.md) [m](../pcourse/loop.py)",
                                  PurePosixPath("notebooks/05_franke.ipynb"), files)
    assert up == "[i](../INSTRUCTORS.md) m (`pcourse/loop.py` in the repository)"


@pytest.mark.parametrize("name", EXERCISES)
def test_a_page_with_solution_code_is_caught(name):
    """The check the browser test runs can fail: the solution's own code is found."""
    lines = _solution_lines(name)
    assert lines, f"{name}: no solution line to look for"
    exercise = nbformat.read(REPO / "exercises" / f"{name}.ipynb", as_version=4)
    shipped = "\n".join(c.source for c in exercise.cells)
    assert book_build.leaked(shipped, lines) == []
    solution = nbformat.read(REPO / "solutions" / f"{name}.ipynb", as_version=4)
    solved = "\n".join(c.source for c in solution.cells)
    assert book_build.leaked(solved, lines), f"{name}: the solution's own lines went unseen"


def test_the_build_refuses_an_exercise_that_holds_its_solution(tmp_path):
    root = tmp_path / "course"
    for part in ("notebooks", "exercises", "solutions"):
        (root / part).mkdir(parents=True)
    for name in ("README.md", "INSTRUCTORS.md", "index.ipynb"):
        (root / name).write_bytes((REPO / name).read_bytes())
    name = EXERCISES[0]
    lesson = course.load(REPO).lesson(course.load(REPO).after(name)).path  # it practises
    (root / lesson).write_bytes((REPO / lesson).read_bytes())
    (root / course.REGISTRY).write_text(
        f'[[lesson]]\nnotebook = "{lesson.as_posix()}"\nteaches = "t"\nmodules = []\n\n'
        f'[[exercise]]\nnotebook = "exercises/{name}.ipynb"\nafter = "{lesson.name[:2]}"\n')
    solution = (REPO / "solutions" / f"{name}.ipynb").read_bytes()
    (root / "solutions" / f"{name}.ipynb").write_bytes(solution)
    (root / "exercises" / f"{name}.ipynb").write_bytes(solution)  # a stale exercise
    with pytest.raises(book_build.BookError, match="holds lines of its solution"):
        book_build.stage(root, tmp_path / "src")
    (root / "exercises" / f"{name}.ipynb").write_bytes(
        (REPO / "exercises" / f"{name}.ipynb").read_bytes())
    pages = book_build.stage(root, tmp_path / "src")
    assert [p.kind for p in pages] == ["index", "lesson", "exercise", "about", "about"]


def test_the_site_follows_the_registry(tmp_path):
    """The site's order is the registry's, and an exercise's page names the lesson it
    practises (staged only: no Sphinx, no browser)."""
    registry = course.load(REPO)
    pages = book_build.stage(REPO, tmp_path / "src")
    assert [p.source for p in pages if p.kind in ("lesson", "exercise")] == \
        [x.path.as_posix() for x in registry.lessons + registry.exercises]
    for x in registry.exercises:
        staged = nbformat.read(tmp_path / "src" / x.path, as_version=4)
        assert f"It practises lesson {x.after}." in staged.cells[1].source, x.name
    toctree = nbformat.read(tmp_path / "src" / "index.ipynb", as_version=4).cells[-1].source
    assert re.findall(r"^notebooks/(\d\d)_", toctree, re.M) == [x.number for x in registry.lessons]


def test_a_plot_without_its_image_is_named():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("plt.plot([1, 2])\nplt.show()"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("plt.show()", outputs=[nbformat.v4.new_output(
            "display_data", {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})])])
    assert book_build.missing_figures(nb) == [0]
    assert book_build.figure_cells(nb) == [0, 2]


# ---------------------------------------------------------------- the build

def _book_unavailable() -> str | None:
    try:
        import myst_nb  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError:
        return "the book extra (Sphinx, MyST-NB, sphinx-book-theme) is not installed"
    return None


def _required(why: str | None, enable: str) -> None:
    if why and os.environ.get("PCOURSE_REQUIRE_BOOK"):
        pytest.fail(f"PCOURSE_REQUIRE_BOOK is set but {why}; {enable}")
    if why:
        pytest.skip(f"book test skipped: {why}. To run it: {enable}")


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> Iterator[dict]:
    """`make book` into a throwaway folder: what pages.json says, plus where and how long."""
    _required(_book_unavailable(), "make book-setup")
    out = tmp_path_factory.mktemp("book")
    start = time.monotonic()
    result = subprocess.run(["make", "book", f"BOOK_ARGS=--out {out}"], cwd=REPO,
                            capture_output=True, text=True, timeout=MAKE_TIMEOUT)
    seconds = time.monotonic() - start
    assert result.returncode == 0, f"make book failed:\n{result.stdout}\n{result.stderr}"
    built = json.loads((out / book_build.PAGES_FILE).read_text())
    built.update(html=out / "html", seconds=seconds, printed=result.stdout)
    yield built


@pytest.fixture
def say(capsys):
    """Print a line in pytest's output even when the test passes (print alone is captured)."""
    def line(text: str) -> None:
        with capsys.disabled():
            print(f"\n{text}")
    return line


@pytest.mark.slow
def test_make_book_renders_every_page_from_its_stored_outputs(book, say):
    say(f"make book: {book['seconds']:.0f} s (its own line: "
        f"{book['printed'].strip().splitlines()[-1]})")
    pages = {p["source"]: p for p in book["pages"]}
    wanted = ["index.ipynb", *(f"notebooks/{n}.ipynb" for n in LESSONS),
              *(f"exercises/{n}.ipynb" for n in EXERCISES), *book_build.ABOUT]
    assert list(pages) == wanted
    for source, page in pages.items():
        text = _text(book["html"] / f"{page['doc']}.html")
        if page["kind"] in ("lesson", "exercise"):
            assert "Run it yourself" in text and "make lab" in text, source
        if page["kind"] == "lesson":  # outputs no rerun reproduces: the stored ones, as is
            line = _stored_timing_line(REPO / source)
            assert line is None or line in text, (source, line)
    assert not list((book["html"]).rglob("solutions/*")), "the site has a solutions folder"
    for name in EXERCISES:
        text = _text(book["html"] / "exercises" / f"{name}.html")
        assert book_build.leaked(text, _solution_lines(name)) == [], name


def _text(page: Path) -> str:
    """A built page's text: its HTML without tags (code is split into tokens there)."""
    return htmllib.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _stored_timing_line(path: Path) -> str | None:
    """The longest stored stdout line with a digit in a cell that nbval does not compare.

    Such a line (seconds, host names, versions) differs from run to run: finding it in
    the page shows the page was rendered from the stored outputs, not re-executed.
    """
    lines = [ln.strip() for cell in nbformat.read(path, as_version=4).cells
             if "nbval-ignore-output" in cell.metadata.get("tags", [])
             for out in cell.get("outputs", []) if out.get("name") == "stdout"
             for ln in out.get("text", "").splitlines()
             if re.search(r"\d", ln) and "  " not in ln.strip()]
    return max(lines, key=len) if lines else None


# ---------------------------------------------------------------- the browser

class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request log on the terminal
        pass


@pytest.fixture(scope="module")
def site(book) -> Iterator[str]:
    """The built site on a loopback web server; yields its base URL."""
    handler = functools.partial(_Quiet, directory=str(book["html"]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser_page(site):
    why = _unavailable()
    _required(why, ENABLE)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        # The site only: a page's fonts or MathJax from elsewhere are not fetched.
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(
            site) else route.abort())
        try:
            yield page
        finally:
            browser.close()


def _open(page, site: str, doc: str) -> None:
    page.goto(f"{site}{doc}.html", wait_until="load")
    page.locator("article").first.wait_for()


def _screenshot(page, name: str, say) -> None:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTEFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    say(f"screenshot: {path}")


_fetched: dict[str, tuple[int, str]] = {}


def _fetch(url: str) -> tuple[int, str]:
    if url not in _fetched:
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                _fetched[url] = (response.status, response.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as exc:
            _fetched[url] = (exc.code, "")
    return _fetched[url]


def _broken_links(page, site: str) -> list[str]:
    """Links of the page in front into the site that lead nowhere: no file, or no anchor."""
    hrefs = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
    broken = []
    for href in sorted(set(hrefs)):
        if not href.startswith(site):
            continue
        url, anchor = urldefrag(href)
        status, body = _fetch(url)
        if status != 200:
            broken.append(f"{href} (HTTP {status})")
        elif anchor and url.endswith(".html") and not re.search(
                rf"""\bid=["']{re.escape(anchor)}["']""", body):
            broken.append(f"{href} (no element with id {anchor!r})")
    return broken


def _unloaded_images(page) -> list[str]:
    """Images of the page whose file did not load (naturalWidth 0), by their src."""
    return page.eval_on_selector_all(
        "article img", "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0))"
        ".map(i => i.getAttribute('src'))")


@pytest.mark.slow
@pytest.mark.parametrize("name", LESSONS)
def test_a_lesson_page_loads_its_images_and_links_and_says_how_to_run_it(
        browser_page, site, say, name):
    page = browser_page
    _open(page, site, f"notebooks/{name}")
    _screenshot(page, f"lesson_{name}", say)
    note = page.locator(".admonition", has_text="Run it yourself")
    assert "make lab" in note.inner_text() and "make test" in note.inner_text(), name
    assert _unloaded_images(page) == [], f"{name}: images that did not load"
    assert _broken_links(page, site) == [], f"{name}: broken links"


def _figure_params() -> list:
    return [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_MISSING_FIGURES[n],
                                                    strict=False))
            if n in KNOWN_MISSING_FIGURES else n for n in LESSONS]


@pytest.mark.slow
@pytest.mark.parametrize("name", _figure_params())
def test_every_plot_of_a_lesson_is_a_loaded_image_on_its_page(browser_page, site, name):
    """Each cell that shows a figure has, in its output on the page, an image that loaded."""
    page = browser_page
    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    _open(page, site, f"notebooks/{name}")
    cells = page.locator("article div.cell")
    assert cells.count() == len(code), f"{name}: {cells.count()} cells on the page, {len(code)}"
    without = []
    for index in book_build.figure_cells(nb):
        loaded = cells.nth(code.index(index)).locator(".cell_output img").evaluate_all(
            "imgs => imgs.filter(i => i.complete && i.naturalWidth > 0).length")
        if not loaded:
            stored = "stored no image" if index in book_build.missing_figures(nb) else \
                "stored an image the page does not show"
            without.append(f"notebooks/{name}.ipynb cell {index}: {stored}")
    assert not without, "figures missing from the page:\n" + "\n".join(without)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXERCISES)
def test_an_exercise_page_holds_no_solution_code(browser_page, site, say, name):
    page = browser_page
    _open(page, site, f"exercises/{name}")
    _screenshot(page, f"exercise_{name}", say)
    code = "\n".join(page.locator("article pre").all_inner_texts())
    assert "YOUR CODE HERE" in code, f"{name}: the page shows no cell to fill in"
    assert book_build.leaked(code, _solution_lines(name)) == [], \
        f"{name}: the page shows lines of the solution"
    assert "PASS" not in page.locator("article .cell_output").all_inner_texts(), name
    assert _broken_links(page, site) == [], f"{name}: broken links"


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["index", *(Path(n).stem for n in book_build.ABOUT)])
def test_the_index_and_about_pages_link_only_to_what_exists(browser_page, site, say, doc):
    page = browser_page
    _open(page, site, doc)
    _screenshot(page, doc, say)
    assert _broken_links(page, site) == [], f"{doc}: broken links"
    text = page.locator("article").inner_text()
    if doc == "index":
        assert "solutions/01_partitioner.ipynb" in text  # named, as a repository path
        assert not page.locator("article a[href*='solutions/']").count()
        # the site's navigation: the lessons in order, then the exercises, then About
        hrefs = page.eval_on_selector_all("nav.bd-links a", "links => links.map(a => a.href)")
        docs = [re.sub(r"\.html$", "", h[len(site):]) for h in hrefs if h.startswith(site)]
        wanted = [f"notebooks/{n}" for n in LESSONS] + [f"exercises/{n}" for n in EXERCISES]
        assert [d for d in docs if d in wanted] == wanted, docs
        assert docs.index("INSTRUCTORS") > docs.index(wanted[-1]), docs


@pytest.mark.slow
def test_the_page_checks_see_a_broken_link_a_missing_anchor_and_an_image_that_failed(
        browser_page, site, book):
    """The checks above can fail: a page made to break each of them is caught by each."""
    (book["html"] / "broken_on_purpose.html").write_text(
        '<html><body><article><a href="no_such_page.html">gone</a> '
        '<a href="index.html#no-such-section">nowhere</a> <a href="index.html">fine</a> '
        '<img src="_images/no_such_figure.png"></article></body></html>')
    _open(browser_page, site, "broken_on_purpose")
    broken = _broken_links(browser_page, site)
    assert len(broken) == 2, broken
    assert "HTTP 404" in broken[1] and "no-such-section" in broken[0], broken
    assert _unloaded_images(browser_page) == ["_images/no_such_figure.png"]
