"""Headless Chromium driven over its DevTools protocol on a pipe (--remote-debugging-pipe):
the standard library only, no web driver. Used by the HTML report's browser tests and by
`make report-screenshot`.

    python tools/chromium.py screenshot REPORT.html OUT.png [--width W --height H]
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-pipe"]


def find() -> Optional[str]:
    """The Chromium binary: $MXVAL_CHROMIUM, else `chromium` (Debian) or `chromium-browser`."""
    env = os.environ.get("MXVAL_CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page. `call(method, **params)` sends a DevTools command
    to the page and returns its result; `errors` collects uncaught exceptions, console errors
    and error log entries."""

    def __init__(self, binary: Optional[str] = None, *, width: int = 1400, height: int = 900,
                 timeout: float = 30.0):
        self.binary = binary or find()
        if not self.binary:
            raise BrowserError("chromium is not installed")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="mxval-chromium-")
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # the child reads commands on fd 3 and writes replies on fd 4
        hi_r, hi_w = os.dup(to_chrome_r), os.dup(from_chrome_w)

        def fds():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.proc = subprocess.Popen([self.binary, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, pass_fds=(3, 4), preexec_fn=fds)
        for fd in (to_chrome_r, from_chrome_w, hi_r, hi_w):
            os.close(fd)
        self._id = 0
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self.errors: list[str] = []
        self._cv = threading.Condition()
        self._closed = False
        self._buf = b""
        threading.Thread(target=self._reader, daemon=True).start()
        self._stderr: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)

    # --- the pipe ---------------------------------------------------------------------------
    def _drain(self):
        for line in self.proc.stderr:
            self._stderr.append(line.decode(errors="replace"))

    def _reader(self):
        while True:
            try:
                chunk = os.read(self._r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cv:
                    self._closed = True
                    self._cv.notify_all()
                return
            self._buf += chunk
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cv:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._event(msg)
                    self._cv.notify_all()

    def _event(self, msg: dict) -> None:
        self.events.append(msg)
        m, p = msg.get("method"), msg.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.errors.append(f"uncaught: {(d.get('exception') or {}).get('description') or d.get('text')}")
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description")))
                                                                        for a in p.get("args", [])))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            self.errors.append(f"log: {p['entry'].get('text')} ({p['entry'].get('url', '')})")

    def _send(self, method: str, params: Optional[dict] = None, session: Optional[str] = None) -> dict:
        with self._cv:
            self._id += 1
            i = self._id
        msg = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + self.timeout
        with self._cv:
            while i not in self._replies:
                if self._closed:
                    raise BrowserError(f"{method}: chromium closed the pipe: {''.join(self._stderr)[-2000:]}")
                left = deadline - time.time()
                if left <= 0:
                    raise BrowserError(f"{method}: no reply in {self.timeout:g} s")
                self._cv.wait(left)
            reply = self._replies.pop(i)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    # --- the page ---------------------------------------------------------------------------
    def call(self, method: str, **params) -> dict:
        return self._send(method, params, self.session)

    def wait_event(self, method: str, since: int = 0) -> dict:
        deadline = time.time() + self.timeout
        with self._cv:
            while True:
                for ev in self.events[since:]:
                    if ev.get("method") == method:
                        return ev
                left = deadline - time.time()
                if left <= 0 or self._closed:
                    raise BrowserError(f"no {method} in {self.timeout:g} s")
                self._cv.wait(left)

    def open(self, path) -> None:
        """Load a local file and wait for its load event."""
        n = len(self.events)
        self.call("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait_event("Page.loadEventFired", n)

    def js(self, expression: str):
        """The value of a JavaScript expression (a promise is awaited); BrowserError when it throws."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise BrowserError(f"{expression[:80]}: {(d.get('exception') or {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the first element matching `selector` (scrolled
        into view first)."""
        box = self.js(f"""(() => {{ const el = document.querySelector({json.dumps(selector)});
            if (!el) return null; el.scrollIntoView({{block: 'center'}});
            const r = el.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        if box is None:
            raise BrowserError(f"click: nothing matches {selector}")
        for t in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=t, x=box[0], y=box[1], button="left", clickCount=1)

    def type_text(self, selector: str, text: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def screenshot(self, out, *, full_height: Optional[int] = None) -> None:
        """A PNG of the page from its top; `full_height` caps how much of the page is drawn."""
        params = {"format": "png"}
        if full_height:
            w = self.js("document.documentElement.clientWidth")
            h = min(full_height, self.js("document.documentElement.scrollHeight"))
            params.update(clip={"x": 0, "y": 0, "width": w, "height": h, "scale": 1}, captureBeyondViewport=True)
        data = self.call("Page.captureScreenshot", **params)["data"]
        Path(out).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._send("Browser.close")
        except BrowserError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="tools/chromium.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("screenshot", help="a PNG of an HTML file's top")
    sh.add_argument("html")
    sh.add_argument("out")
    sh.add_argument("--width", type=int, default=1400)
    sh.add_argument("--height", type=int, default=1600)
    a = ap.parse_args(argv)
    if not find():
        print("chromium.py: chromium is not installed (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    with Browser(width=a.width, height=900) as b:
        b.open(a.html)
        b.screenshot(a.out, full_height=a.height)
        if b.errors:
            print("chromium.py: the page reported errors: " + "; ".join(b.errors), file=sys.stderr)
            return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
