"""Screenshots of the chat page for the README, from a real run: `nanoqwen serve` on a model, one question
asked in headless Chromium (Debian's `chromium`, driven by Playwright), the page taken in light and in dark
mode after the streamed answer.

    .venv/bin/python scripts/chat_page_screenshots.py                  # ./run.sh's model (random weights
                                                                       # of the Qwen3-0.6B shape offline)
    .venv/bin/python scripts/chat_page_screenshots.py --model DIR --out docs/images
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Give me a short introduction to large language models."


def start_server(model: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "nanoqwen", "serve", "--model", model, "--port", str(port),
                             "--served-model-name", Path(model).name, "--max-model-len", "4096"])
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"`nanoqwen serve --model {model}` did not start")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models/qwen3-0.6b-random"))
    parser.add_argument("--out", default=str(ROOT / "docs/images"), help="folder for chat-page-{light,dark}.png")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-tokens", type=int, default=80)
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("needs Debian's chromium: apt-get install chromium")
    if not (Path(args.model) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "nanoqwen", "init-random", args.model, "--preset", "qwen3-0.6b"],
                       check=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = start_server(args.model, args.port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            context = browser.new_context(viewport={"width": 1100, "height": 720}, color_scheme="light")
            page = context.new_page()
            page.goto(f"http://127.0.0.1:{args.port}/")
            page.get_by_text(Path(args.model).name, exact=True).wait_for()
            page.get_by_role("button", name="Settings", exact=True).click()
            page.get_by_label("Max tokens", exact=True).fill(str(args.max_tokens))
            page.get_by_role("button", name="Save", exact=True).click()
            page.get_by_label("Message", exact=True).fill(QUESTION)
            page.get_by_label("Message", exact=True).press("Enter")
            page.wait_for_function("() => document.querySelector('.stats')?.textContent", timeout=120_000)
            page.screenshot(path=out / "chat-page-light.png")
            page.emulate_media(color_scheme="dark")
            page.screenshot(path=out / "chat-page-dark.png")
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"wrote {out / 'chat-page-light.png'} and {out / 'chat-page-dark.png'}")


if __name__ == "__main__":
    main()
