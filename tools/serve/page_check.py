#!/usr/bin/env python3
"""Drives `tessera serve`'s page (GET /) in headless Chromium over the DevTools protocol, as a
user would: waits for the placement and the ranks' table to load, types a message, sets the
temperature to 0, presses Send, waits for the streamed answer to finish, and takes a
screenshot. Prints one JSON object of what the page showed (crates/cli/tests/serve.rs checks it).

  python tools/serve/page_check.py BASE_URL CHROMIUM SCREENSHOT.png MESSAGE [MAX_TOKENS]
"""
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

base, chromium, screenshot, message = sys.argv[1:5]
max_tokens = sys.argv[5] if len(sys.argv) > 5 else "24"
DEADLINE_S = 90


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


port = free_port()
profile = tempfile.mkdtemp(prefix="tessera-page-")
browser = subprocess.Popen(
    [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
     f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "--window-size=1280,800", "about:blank"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    t0 = time.time()
    while True:
        try:
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json"))
            page = next(t for t in targets if t["type"] == "page")
            break
        except Exception:
            if time.time() - t0 > DEADLINE_S:
                raise SystemExit("chromium's DevTools never answered")
            time.sleep(0.1)
    ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=DEADLINE_S, suppress_origin=True)
    next_id = [0]

    def call(method, **params):
        next_id[0] += 1
        ws.send(json.dumps({"id": next_id[0], "method": method, "params": params}))
        while True:
            reply = json.loads(ws.recv())
            if reply.get("id") == next_id[0]:
                if "error" in reply:
                    raise SystemExit(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def js(expression):
        r = call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise SystemExit(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(expression, what):
        t = time.time()
        while not js(expression):
            if time.time() - t > DEADLINE_S:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.1)

    call("Page.enable")
    call("Runtime.enable")
    call("Page.navigate", url=base + "/")
    wait_for("document.readyState === 'complete' && document.getElementById('placement').textContent !== ''", "the placement")
    wait_for("document.querySelectorAll('#ranks tr td').length > 1", "the ranks' table")
    # Type as a user: focus, insert the text, set the sampling fields, press Send.
    js("document.getElementById('input').focus()")
    call("Input.insertText", text=message)
    js("document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '" + max_tokens + "'")
    js("document.getElementById('send').click()")
    wait_for("(() => { const a = document.querySelector('.assistant'); return a && a.dataset.state && a.dataset.state !== 'streaming'; })()", "the answer")
    # One more poll, so the numbers include this chat.
    time.sleep(1.2)
    shot = call("Page.captureScreenshot", format="png")
    with open(screenshot, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    out = js("""(() => ({
      model: document.getElementById('model').textContent,
      placement: document.getElementById('placement').textContent,
      ready: document.getElementById('ready').textContent,
      answer: document.querySelector('.assistant').textContent,
      state: document.querySelector('.assistant').dataset.state,
      errors: [...document.querySelectorAll('.error')].map(e => e.textContent),
      ranks: [...document.querySelectorAll('#ranks tr')].map(r => [...r.children].map(c => c.textContent)),
      tps: document.getElementById('tps').textContent,
      queue: document.getElementById('queue').textContent,
      done: document.getElementById('done').textContent,
    }))()""")
    out["screenshot_bytes"] = os.path.getsize(screenshot)
    print(json.dumps(out))
    ws.close()
finally:
    browser.kill()
    browser.wait()
    shutil.rmtree(profile, ignore_errors=True)
