"""The chat page at `/`, driven in headless Chromium (Debian's, through Playwright): against a real
`nanoqwen serve` on a tiny random model (streaming, Stop freeing the request, reload), and against an
in-process app over a ScriptedEngine for what a random model cannot show (a reasoning block, Markdown,
hostile HTML in an answer, a failure) or where the server-side SamplingParams are checked."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from server_testing import ScriptedEngine, metrics, nanoqwen_serve, serve_app, wait_idle

from nanoqwen.entrypoints.server import build_app
from nanoqwen.tokenizer import Tokenizer

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
API_KEY = "sesame"
MAX_MODEL_LEN = 4096
SPEED_LINE = re.compile(r"^\d+ prompt tokens, \d+ ms to first token · \d+ tokens, \d+\.\d tok/s$")
MARKDOWN = """## A heading

Some **bold**, *italic*, `code` and a [link](https://example.com/docs).

- one
- two
  - nested

1. first
2. second

> quoted

| name | value |
|:-----|------:|
| a    | 1     |

```python
print("hi")
```
"""
HOSTILE = ('<img src=x onerror="window.__xss = 1"> <script>window.__xss = 2</script> '
           '[click](javascript:window.__xss=3) <b onmouseover="window.__xss=4">bold?</b>')


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.skip(f"Playwright is not installed ({e}); ./test.sh installs it with the test extras")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed: scripts/setup.sh --test installs Debian's `chromium` "
                    "with apt-get, which failed or is not available here")
    return sync_playwright, chromium


@pytest.fixture(scope="module")
def browser():
    sync_playwright, chromium = _browser_or_skip()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()


def script(prompt: str) -> str:
    """The scripted model's answer to the last user turn."""
    prompt = prompt.rsplit("<|im_start|>user", 1)[-1]
    if "FAIL" in prompt:
        return "FAIL"
    if "markdown" in prompt:
        return MARKDOWN
    if "hostile" in prompt:
        return HOSTILE
    if "long" in prompt:
        return "<think>\nA long thought.\n</think>\n\n" + "word " * 400
    return "<think>\nLet me think about it.\n</think>\n\nHello there! How can I help?"


@pytest.fixture(scope="module")
def scripted(checkpoint):
    """An in-process server (with an API key) over a ScriptedEngine, on a free port."""
    engine = ScriptedEngine(Tokenizer.from_pretrained(checkpoint("tiny", dtype="float32")), script,
                            chunk=2, step_seconds=0.01)
    with serve_app(build_app(engine, "scripted", api_key=API_KEY), timeout=30) as base:
        yield SimpleNamespace(engine=engine, base=base)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """A real `nanoqwen serve` on the tiny random model."""
    log = tmp_path_factory.mktemp("chat-page") / "server.log"
    with nanoqwen_serve(checkpoint("tiny", dtype="float32"), log, "--dtype", "float32", "--device", "cpu",
                        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB",
                        "--served-model-name", "tiny", "--seed", "0") as server:
        yield server


def open_page(browser, base: str, api_key: str | None = API_KEY, **context_options):
    """A fresh browser profile (empty localStorage, or only the API key) on the chat page."""
    context = browser.new_context(**context_options)
    if api_key is not None:
        context.add_init_script("try { localStorage.getItem('nanoqwen.apiKey') ?? "
                                f"localStorage.setItem('nanoqwen.apiKey', {json.dumps(api_key)}) }} catch {{}}")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(base + "/")
    return page


@pytest.fixture
def page(browser, scripted) -> Iterator:
    page = open_page(browser, scripted.base)
    page.get_by_text("scripted", exact=True).wait_for()  # /props answered: the model's name
    yield page
    assert page.errors == [], page.errors  # no uncaught JavaScript error
    page.context.close()


def set_max_tokens(page, n: int) -> None:
    page.get_by_role("button", name="Settings", exact=True).click()
    page.get_by_label("Max tokens", exact=True).fill(str(n))
    page.get_by_role("button", name="Save", exact=True).click()


def ask(page, text: str) -> None:
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")


def last_answer(page):
    return page.locator("article.message.assistant").last


def wait_answered(page, timeout: float = 30_000) -> None:
    """Until no answer streams (Send is enabled again)."""
    page.wait_for_function("() => !document.getElementById('send').disabled "
                           "&& !document.querySelector('article.streaming')", timeout=timeout)


def record_answer_text(page) -> None:
    """From now on, window.__seen collects [reasoning length, answer length, thinking open] at each
    change of the page."""
    page.evaluate("""() => {
        window.__seen = [];
        new MutationObserver(() => {
            const a = [...document.querySelectorAll('article.message.assistant')].pop();
            if (!a) return;
            window.__seen.push([a.querySelector('.reasoning').textContent.length,
                                a.querySelector('.content').textContent.length,
                                a.querySelector('.thinking').open]);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true, attributes: true});
    }""")


# ---------------------------------------------------------------- a real server


def test_serve_prints_the_page_url_and_serves_it(served):
    port = served.base.rsplit(":", 1)[1]
    assert f"chat page: http://127.0.0.1:{port}/" in served.log.read_text()
    page = httpx.get(served.base + "/")
    assert page.status_code == 200 and 'aria-label="Message"' in page.text
    for asset in ("ui/chat.js", "ui/markdown.js", "ui/chat.css"):
        assert httpx.get(f"{served.base}/{asset}").status_code == 200, asset


def test_an_answer_streams_into_the_page_with_its_speed(browser, served):
    page = open_page(browser, served.base, api_key=None)
    page.get_by_text("tiny", exact=True).wait_for()
    set_max_tokens(page, 400)
    record_answer_text(page)
    ask(page, "Hello")
    wait_answered(page)
    # the text grew in several steps while the answer streamed (as Markdown it may also shrink, when a
    # closing ** turns two asterisks into bold)
    totals = [r + c for r, c, _ in page.evaluate("window.__seen")]
    assert len({t for t in totals if t}) >= 3, totals
    stats = last_answer(page).locator(".stats").inner_text()
    assert SPEED_LINE.match(stats), stats
    generated = int(re.search(r"· (\d+) tokens", stats).group(1))
    assert 0 < generated <= 400
    assert page.locator("article.message.user .content").inner_text() == "Hello"
    page.context.close()


def test_stop_ends_the_request_on_the_server(browser, served):
    page = open_page(browser, served.base, api_key=None)
    page.get_by_text("tiny", exact=True).wait_for()
    ask(page, "Tell me everything")  # no max tokens: up to the 4096-token context
    page.wait_for_function("() => document.querySelector('article.streaming')?.textContent.length > 20")
    assert metrics(served.base)["nanoqwen_num_requests_running"] == 1
    page.get_by_role("button", name="Stop", exact=True).click()
    m = wait_idle(served.base, timeout=10)
    assert m["nanoqwen_num_requests_running"] == 0 and m["nanoqwen_kv_cache_used_blocks"] == 0
    wait_answered(page)
    answer = last_answer(page)
    assert answer.locator(".error").inner_text() == "Stopped."
    assert len(answer.inner_text()) > 20  # what came before Stop is kept
    assert page.get_by_role("button", name="Stop", exact=True).is_hidden()
    page.context.close()


def test_the_conversation_survives_a_reload(browser, served):
    page = open_page(browser, served.base, api_key=None)
    page.get_by_text("tiny", exact=True).wait_for()
    set_max_tokens(page, 8)
    ask(page, "Remember me")
    wait_answered(page)
    before = last_answer(page).locator(".content").inner_text()
    page.reload()
    page.get_by_text("tiny", exact=True).wait_for()
    assert texts_when(page.locator("#conversations .conversation"), ["Remember me"]) == ["Remember me"]
    assert page.locator("article.message.user .content").inner_text() == "Remember me"
    assert last_answer(page).locator(".content").inner_text() == before
    page.get_by_role("button", name="Settings", exact=True).click()
    assert page.get_by_label("Max tokens", exact=True).input_value() == "8"  # settings persist too
    page.get_by_role("button", name="Cancel", exact=True).click()
    page.context.close()


# ---------------------------------------------------------------- a scripted engine


def test_settings_reach_the_request(page, scripted):
    page.get_by_role("button", name="Settings", exact=True).click()
    # the checkpoint's defaults are shown where a field is empty
    assert page.get_by_label("Temperature", exact=True).get_attribute("placeholder") == "0.6"
    assert page.get_by_label("Top-k", exact=True).get_attribute("placeholder") == "20"
    page.get_by_label("System prompt", exact=True).fill("You are terse.")
    for label, value in [("Temperature", "0.3"), ("Top-p", "0.5"), ("Top-k", "7"), ("Max tokens", "33"),
                         ("Seed", "1234")]:
        page.get_by_label(label, exact=True).fill(value)
    page.get_by_role("button", name="Save", exact=True).click()
    page.get_by_label("Thinking", exact=True).uncheck()
    ask(page, "What are the settings?")
    wait_answered(page)
    params, prompt = scripted.engine.params[-1], scripted.engine.prompts[-1]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (0.3, 0.5, 7, 33, 1234)
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in prompt
    assert prompt.endswith("<think>\n\n</think>\n\n")  # thinking off: the template's empty block
    # and left empty, the server's defaults apply
    page.get_by_role("button", name="Settings", exact=True).click()
    page.get_by_role("button", name="Reset", exact=True).click()
    page.get_by_role("button", name="Save", exact=True).click()
    page.get_by_label("Thinking", exact=True).check()
    ask(page, "And now?")
    wait_answered(page)
    params, prompt = scripted.engine.params[-1], scripted.engine.prompts[-1]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.6, 0.95, 20, None)
    assert "system" not in prompt and not prompt.endswith("</think>\n\n")


def test_thinking_streams_in_its_block_then_folds(page):
    record_answer_text(page)
    ask(page, "Think first")
    wait_answered(page)
    seen = page.evaluate("window.__seen")
    # while only reasoning had arrived, it showed in an open Thinking block
    assert any(r > 0 and c == 0 and is_open for r, c, is_open in seen), seen
    answer = last_answer(page)
    thinking = answer.locator("details.thinking")
    assert thinking.get_attribute("open") is None  # folded once the answer began
    assert answer.locator(".content").inner_text() == "Hello there! How can I help?"
    thinking.locator("summary").click()
    assert answer.locator(".reasoning").inner_text().strip() == "Let me think about it."


def test_markdown_is_rendered(page):
    ask(page, "Show me markdown")
    wait_answered(page)
    content = last_answer(page).locator(".content")
    assert content.locator("h2").inner_text() == "A heading"
    assert content.locator("strong").inner_text() == "bold" and content.locator("em").inner_text() == "italic"
    assert content.locator("a").get_attribute("href") == "https://example.com/docs"
    assert content.locator(":scope > ul > li").count() == 2 and content.locator("ul ul > li").inner_text() == "nested"
    assert content.locator(":scope > ol > li").all_inner_texts() == ["first", "second"]
    assert content.locator("blockquote").inner_text() == "quoted"
    assert content.locator("th").all_inner_texts() == ["name", "value"]
    assert content.locator("td").all_inner_texts() == ["a", "1"]
    assert content.locator("pre code").inner_text() == 'print("hi")'
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    content.get_by_role("button", name="Copy code", exact=True).click()
    assert page.evaluate("navigator.clipboard.readText()") == 'print("hi")'


def test_html_in_an_answer_stays_text(page):
    ask(page, "Say something hostile")
    wait_answered(page)
    content = last_answer(page).locator(".content")
    page.wait_for_timeout(300)  # time for an injected handler to have fired
    assert page.evaluate("window.__xss") is None
    assert content.locator("img, script, b, a").count() == 0
    text = content.inner_text()
    assert '<img src=x onerror="window.__xss = 1">' in text and "<script>window.__xss = 2</script>" in text
    assert "click" in text


def test_regenerate_edit_and_copy(page, scripted):
    ask(page, "First question")
    wait_answered(page)
    asked = len(scripted.engine.prompts)
    page.get_by_role("button", name="Regenerate", exact=True).click()
    wait_answered(page)
    assert len(scripted.engine.prompts) == asked + 1
    assert scripted.engine.prompts[-1].count("First question") == 1
    assert page.locator("article.message").count() == 2  # the answer was replaced, not added
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    last_answer(page).get_by_role("button", name="Copy", exact=True).click()
    assert page.evaluate("navigator.clipboard.readText()") == "Hello there! How can I help?"
    # edit the question: the conversation continues from there
    page.locator("article.message.user").get_by_role("button", name="Edit", exact=True).click()
    page.get_by_label("Edit message", exact=True).fill("Second question")
    page.get_by_role("button", name="Save and send", exact=True).click()
    wait_answered(page)
    assert page.locator("article.message").count() == 2
    assert page.locator("article.message.user .content").inner_text() == "Second question"
    assert "First question" not in scripted.engine.prompts[-1]


def texts_when(locator, expected: list[str], timeout: float = 10.0) -> list[str]:
    """The locator's inner texts once they equal `expected`, or as they are after `timeout` seconds: the page
    renders some changes after the action returns (an imported file is read asynchronously)."""
    deadline = time.monotonic() + timeout
    while (got := locator.all_inner_texts()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_conversations_new_switch_delete_export_import(page, tmp_path):
    ask(page, "Conversation one")
    wait_answered(page)
    page.get_by_label("New chat", exact=True).click()
    ask(page, "Conversation two")
    wait_answered(page)
    titles = page.locator("#conversations .conversation")
    assert texts_when(titles, ["Conversation two", "Conversation one"]) == ["Conversation two", "Conversation one"]
    titles.nth(1).click()
    assert page.locator("article.message.user .content").inner_text() == "Conversation one"
    with page.expect_download() as download:
        page.get_by_label("Export conversation", exact=True).click()
    exported = json.loads(download.value.path().read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][1]["content"] == "Hello there! How can I help?"
    page.on("dialog", lambda d: d.accept())  # the confirm() before a delete
    page.get_by_label("Delete conversation Conversation one", exact=True).click()
    assert texts_when(titles, ["Conversation two"]) == ["Conversation two"]
    stored = json.loads(page.evaluate("localStorage.getItem('nanoqwen.conversations')"))
    assert [c["title"] for c in stored] == ["Conversation two"]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(exported))
    page.get_by_label("Import conversation", exact=True).set_input_files(str(path))
    assert texts_when(titles, ["Conversation one", "Conversation two"]) == ["Conversation one", "Conversation two"]
    assert last_answer(page).locator(".content").inner_text() == "Hello there! How can I help?"
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "wizard"}]}')
    page.get_by_label("Import conversation", exact=True).set_input_files(str(bad))
    assert "bad.json is not a conversation exported from this page" in page.get_by_role("alert").inner_text()
    assert titles.count() == 2


def test_errors_show_and_keep_the_conversation(page):
    ask(page, "A fine question")
    wait_answered(page)
    ask(page, "Please FAIL")  # the engine fails mid-request: an error event in the stream
    wait_answered(page)
    assert "scripted failure" in last_answer(page).locator(".error").inner_text()
    # the connection drops
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))
    ask(page, "Anyone there?")
    wait_answered(page)
    assert "connection to the server was lost" in last_answer(page).locator(".error").inner_text()
    page.unroute("**/v1/chat/completions")
    users = page.locator("article.message.user .content").all_inner_texts()
    assert users == ["A fine question", "Please FAIL", "Anyone there?"]
    assert page.locator("article.message.assistant .content").first.inner_text() == "Hello there! How can I help?"
    page.reload()
    assert page.locator("article.message.user").count() == 3


def test_the_api_key_is_asked_once(browser, scripted):
    page = open_page(browser, scripted.base, api_key=None)
    dialog = page.get_by_role("dialog", name="API key")
    dialog.wait_for()  # /props answered 401
    dialog.locator("input").fill(API_KEY)
    dialog.get_by_role("button", name="Save", exact=True).click()
    page.get_by_text("scripted", exact=True).wait_for()
    assert page.evaluate("localStorage.getItem('nanoqwen.apiKey')") == API_KEY
    page.reload()
    page.get_by_text("scripted", exact=True).wait_for()
    assert not dialog.is_visible()
    ask(page, "With a key")
    wait_answered(page)
    assert last_answer(page).locator(".content").inner_text() == "Hello there! How can I help?"
    page.context.close()


def test_phone_width_dark_mode_and_keyboard(browser, scripted):
    page = open_page(browser, scripted.base, viewport={"width": 390, "height": 800}, color_scheme="dark")
    page.get_by_text("scripted", exact=True).wait_for()
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(23, 24, 27)"
    sidebar = page.locator("#sidebar")
    assert sidebar.bounding_box()["x"] + sidebar.bounding_box()["width"] <= 0  # slid away
    page.get_by_role("button", name="Conversations", exact=True).click()
    page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().x >= 0")
    page.keyboard.press("Escape")
    page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().right <= 0")
    # the message box fits the screen
    box = page.get_by_label("Message", exact=True).bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390
    # keyboard only: type, Shift+Enter makes a new line, Enter sends
    page.get_by_label("Message", exact=True).focus()
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    page.keyboard.press("Enter")
    wait_answered(page)
    assert page.locator("article.message.user .content").inner_text() == "line one\nline two"
    # every control has a name a screen reader can say
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, textarea')]
        .filter((e) => !e.hidden && !e.getAttribute('aria-label') && !e.labels?.length && !e.textContent.trim())
        .map((e) => e.outerHTML)""")
    assert unnamed == []
    page.context.close()


def test_no_ui_turns_the_page_off(checkpoint):
    engine = ScriptedEngine(Tokenizer.from_pretrained(checkpoint("tiny", dtype="float32")), script)
    with TestClient(build_app(engine, "scripted", ui=False)) as http:
        assert http.get("/").status_code == 404 and http.get("/ui/chat.js").status_code == 404
        assert http.get("/props").json()["model_alias"] == "scripted"  # the API is unchanged
    with TestClient(build_app(engine, "scripted")) as http:
        assert http.get("/").status_code == 200
        assert "javascript" in http.get("/ui/chat.js").headers["content-type"]
