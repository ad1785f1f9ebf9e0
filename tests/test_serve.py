"""The OpenAI-compatible server: official client, streaming, concurrency, errors, disconnects, web page."""
import html
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from dominotree.serve import create_app  # noqa: E402  (needs fastapi)

from conftest import random_drafter  # noqa: E402
from helpers import ScriptedDrafter, reference_sequence, zero_head  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tiny_target):
    # a drafter that knows most of the greedy answer to "hello world" (and its 7-token lookalikes)
    ref, _ = reference_sequence(tiny_target, tiny_target.encode_prompt("hello world"), 240)
    drafter = ScriptedDrafter(zero_head(random_drafter(True)), ref, wrong_rate=0.2)
    app = create_app(tiny_target, drafter, "dominotree", MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.server
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def base(served):
    return served[0]


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


def chat(base, content, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 24, **kw}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_models_and_page(base):
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    models = httpx.get(f"{base}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "<textarea" in page.text and 'value="dominotree"' in page.text and 'value="ar"' in page.text


def test_openai_client_chat_stream_and_completions(client, base):
    msgs = [{"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    n = r.usage.completion_tokens
    assert 0 < n <= 30 and r.usage.total_tokens == r.usage.prompt_tokens + n
    spec = r.model_extra["spec"]
    assert spec["method"] == "dominotree" and spec["tau"] > 1.5 and spec["rounds"] >= 1

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == n
    rounds = [c for c in chunks if "round_tokens" in (c.model_extra.get("spec") or {})]
    assert sum(c.model_extra["spec"]["round_tokens"] for c in rounds) == n
    assert any(c.model_extra["spec"]["accepted"] > 0 for c in rounds)
    assert all(c.model_extra["spec"]["draft_chars"] <= len(c.choices[0].delta.content) for c in rounds)

    # sampling is seeded
    sample = [client.chat.completions.create(model=MODEL, messages=msgs, temperature=0.9, seed=s, max_tokens=30)
              .choices[0].message.content for s in (1, 1, 2)]
    assert sample[0] == sample[1]

    # plain decoding through the `method` field gives the same greedy answer (lossless)
    ar = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30,
                                        extra_body={"method": "ar"})
    assert ar.choices[0].message.content == text and ar.model_extra["spec"]["method"] == "ar"

    # raw completions: no chat template; model may be omitted; stop strings cut the text
    c = client.completions.create(model=MODEL, prompt="hello world the", temperature=0, max_tokens=20)
    words = c.choices[0].text.split()
    assert words and c.usage.prompt_tokens == 3
    r2 = httpx.post(f"{base}/v1/completions", json={"prompt": "hello world the", "temperature": 0,
                                                   "max_tokens": 20, "stop": words[-1]}).json()
    assert words[-1] not in r2["choices"][0]["text"] and r2["choices"][0]["finish_reason"] == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="hello world the", temperature=0, max_tokens=20,
                                              stop=[words[-1]], stream=True))
    assert "".join(s.choices[0].text for s in streamed) == r2["choices"][0]["text"]


def test_top_k_is_honoured_and_no_op_options_are_accepted(base):
    greedy = chat(base, "hello world", max_tokens=30)["choices"][0]["message"]["content"]
    # top_k=1 at T = 1 is greedy, for seeds whose sample without it is not (the negative control)
    free = {s: chat(base, "hello world", max_tokens=30, temperature=1.0, seed=s)["choices"][0]["message"]["content"]
            for s in range(3, 7)}
    seeds = [s for s, text in free.items() if text != greedy]
    assert seeds
    assert all(chat(base, "hello world", max_tokens=30, temperature=1.0, top_k=1, seed=s)
               ["choices"][0]["message"]["content"] == greedy for s in seeds)
    # the options a server does not implement are fine at their no-op values (clients send those)
    same = chat(base, "hello world", max_tokens=30, presence_penalty=0, frequency_penalty=0.0, logprobs=False,
                logit_bias={}, top_k=-1)
    assert same["choices"][0]["message"]["content"] == greedy
    # text content parts (as newer clients send them) are the same prompt as a string
    parts = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={"max_tokens": 30, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]}).json()
    assert parts["choices"][0]["message"]["content"] == greedy


def test_concurrent_clients_get_their_own_answers(client):
    def ask(i):   # chat and raw completions, streamed or not, different prompts and lengths
        kw = dict(model=MODEL, temperature=0, max_tokens=12 + 3 * i, stream=i % 3 == 0)
        if i % 2:
            r = client.completions.create(prompt=f"w{10 + 7 * i} world w{20 + i}", **kw)
            return "".join(c.choices[0].text for c in r) if kw["stream"] else r.choices[0].text
        r = client.chat.completions.create(messages=[{"role": "user", "content": f"hello w{30 + i}"}], **kw)
        return "".join(c.choices[0].delta.content or "" for c in r) if kw["stream"] else r.choices[0].message.content

    alone = [ask(i) for i in range(8)]
    assert len(set(alone)) == 8
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone


LONG = "hello " * 300   # the tiny model's context is 256 tokens


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", b"{not json", 400, None, None),
    ("/v1/chat/completions", [1, 2], 400, None, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "n": 2}, 400, "n", "invalid_value"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hello"}]}, 404, "model",
     "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "temperature": -1}, 400,
     "temperature", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "temperature": "hot"}, 400,
     "temperature", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 0}, 400,
     "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "top_p": 0}, 400, "top_p",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "method": "beam"}, 400,
     "method", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "stop": 5}, 400, "stop",
     "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "seed": 2 ** 70}, 400, "seed",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "stop": [""]}, 400, "stop",
     "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "logprobs": True}, 400,
     "logprobs", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
     "messages", "invalid_value"),
    ("/v1/completions", {"prompt": "hello", "presence_penalty": 0.5}, 400, "presence_penalty",
     "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hello", "logit_bias": {"5": 100}}, 400, "logit_bias", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hello", "top_k": -3}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "   "}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": {"text": "hello"}}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [1, 999999]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": LONG, "stream": True}, 400, "prompt", "context_length_exceeded"),
    ("/v1/nowhere", {}, 404, None, "not_found"),
])
def test_bad_requests_get_openai_errors(base, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{base}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}])
    assert e.value.code == "context_length_exceeded" and "context length" in e.value.message


def test_disconnect_mid_stream_frees_the_server(served, tiny_target):
    base, drafter = served[0], served[1].drafter
    calls = drafter.calls
    before = chat(base, "the world", max_tokens=200)
    full_rounds, calls = drafter.calls - calls, drafter.calls
    assert before["choices"][0]["finish_reason"] == "length" and full_rounds > 10
    body = {"messages": [{"role": "user", "content": "the world"}], "temperature": 0, "max_tokens": 200,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        health = httpx.get(f"{base}/health", timeout=5).json()   # the event loop answers mid-generation
        assert health["busy"] is True
        # one chunk, then hang up
    after = chat(base, "the world", max_tokens=200)
    assert drafter.calls - calls < 2 * full_rounds     # the abandoned generation stopped early
    assert after["choices"] == before["choices"] and after["usage"] == before["usage"]
    assert tiny_target._pending == 0
    assert httpx.get(f"{base}/health").json()["busy"] is False


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3/4, NUL-separated JSON):
    --dump-dom with --virtual-time-budget does not wait for a streamed fetch body."""

    def __init__(self, exe, url, profile):
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", url]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome} 4>&{from_chrome}', exe, *flags],
                                     pass_fds=(to_chrome, from_chrome), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_chrome), os.close(from_chrome)
        self.killer = threading.Timer(40, self.proc.kill)   # a hung browser ends the reads with EOF
        self.killer.start()
        self.buf, self.n = b"", 0
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def send(self, method, session=None, **params):
        self.n += 1
        os.write(self._w, json.dumps({"id": self.n, "method": method, "params": params,
                                      **({"sessionId": session} if session else {})}).encode() + b"\0")
        while True:
            while b"\0" not in self.buf:
                chunk = os.read(self._r, 1 << 16)
                if not chunk:
                    raise EOFError("chromium went away")
                self.buf += chunk
            msg, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(msg)
            if reply.get("id") == self.n:
                return reply.get("result", reply)

    def js(self, expression):
        reply = self.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True)
        return reply["result"].get("value")

    def close(self):
        self.killer.cancel()
        self.proc.kill()
        self.proc.wait()
        os.close(self._w), os.close(self._r)


def test_page_streams_in_headless_chromium(base, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed")
    expected = chat(base, "hello world", max_tokens=64)["choices"][0]["message"]["content"]
    browser = Chromium(exe, f"{base}/?prompt=hello%20world&autorun=1&method=dominotree&max=64", tmp_path)
    try:
        status = None
        for _ in range(150):
            status = browser.js("document.getElementById('status') && document.getElementById('status').textContent")
            if status not in (None, "idle", "running"):
                break
            time.sleep(0.1)
        assert status == "done", status
        out = browser.js("document.getElementById('out').innerHTML")
        stats = browser.js("document.getElementById('stats').textContent")
    finally:
        browser.close()
    assert html.unescape(re.sub(r"<[^>]+>", "", out)) == expected
    assert '<span class="d">' in out          # accepted draft tokens are highlighted
    assert "tok/s" in stats and "tau" in stats


def test_server_wide_lookup_reaches_each_request_and_bad_values_fail_at_start(tiny_target):
    from dominotree.serve import Server
    srv = Server(tiny_target, random_drafter(True), "dominotree", MODEL, lookup=4)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    assert srv.parse(body, chat=True)[0].lookup == 4
    assert srv.parse({**body, "method": "ar"}, chat=True)[0].lookup == 0     # plain decoding has no tree
    with pytest.raises(ValueError, match="lookup"):
        Server(tiny_target, random_drafter(True), "dominotree", MODEL, lookup=-1)
    with pytest.raises(ValueError, match="needs lookup=N > 0"):
        Server(tiny_target, random_drafter(True), "dominotree", MODEL, lookup_store="train-data")
    with pytest.raises(FileNotFoundError, match="not a directory of training shards"):
        Server(tiny_target, random_drafter(True), "dominotree", MODEL, lookup=4, lookup_store="/nonexistent")


def test_server_wide_lookup_store_reaches_each_request(tiny_target, tmp_path):
    from dominotree.serve import Server
    from dominotree.train.data import Sequence, write_shard
    write_shard(tmp_path / "shard_00000.npz", [Sequence(np.array([1, 5, 6, 7, 8, 9]), 1, "test")])
    srv = Server(tiny_target, random_drafter(True), "dominotree", MODEL, lookup=4, lookup_store=str(tmp_path))
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    assert srv.parse(body, chat=True)[0].lookup_store == str(tmp_path)
    assert srv.parse({**body, "method": "ar"}, chat=True)[0].lookup_store is None


def test_server_wide_draft_vocab_reaches_each_request_and_bad_values_fail_at_start(tiny_target, tmp_path):
    from dominotree.serve import Server
    from dominotree.train.data import Sequence, write_shard
    write_shard(tmp_path / "shard_00000.npz", [Sequence(np.array([1, 5, 6, 7, 8, 9]), 1, "test")])
    srv = Server(tiny_target, random_drafter(True), "dominotree", MODEL, draft_vocab=64, draft_vocab_source=str(tmp_path))
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    cfg = srv.parse(body, chat=True)[0]
    assert (cfg.draft_vocab, cfg.draft_vocab_source) == (64, str(tmp_path))
    assert srv.parse({**body, "method": "ar"}, chat=True)[0].draft_vocab == 0
    with pytest.raises(FileNotFoundError, match="give draft_vocab_source a directory"):
        Server(tiny_target, random_drafter(True), "dominotree", MODEL, draft_vocab=64)   # no train_data for it
    with pytest.raises(ValueError, match="smaller than the 64 candidates"):
        Server(tiny_target, random_drafter(True), "dominotree", MODEL, draft_vocab=8, draft_vocab_source=str(tmp_path))


def test_the_serve_command_answers_and_a_busy_port_is_one_clear_error(tiny_llama_dir, capsys, monkeypatch):
    import sys
    from dominotree.cli import main
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    loads = []
    monkeypatch.setattr("dominotree.load_target", lambda *a, **k: loads.append(a))
    assert main(["serve", "--model", str(tiny_llama_dir), "--method", "ar", "--port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1:%d" % port in capsys.readouterr().err and not loads   # before the model
    assert main(["serve", "--model", str(tiny_llama_dir), "--method", "ar", "--port", "70000"]) == 2
    assert "--port must be 0-65535, got 70000" in capsys.readouterr().err and not loads      # not an OverflowError
    busy.close()
    monkeypatch.undo()
    # the command itself, in a process of its own, serves the model on the now free port
    proc = subprocess.Popen([sys.executable, "-m", "dominotree.cli", "serve", "--model", str(tiny_llama_dir),
                             "--method", "ar", "--dtype", "fp32", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "hello world", "temperature": 0, "max_tokens": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_adaptive_server_loads_its_cost_model_at_start(tiny_target, tmp_path, monkeypatch):
    from dominotree.serve import Server
    from dominotree.trees.caddtree import profile
    import dominotree as dt
    monkeypatch.setattr("dominotree.trees.builders.DEFAULT_COST_MODEL", "no-such-cost-model.json")   # none cached
    drafter = random_drafter(True)
    for method in ("caddtree", "condadaptive"):    # was a 400 on every request, the server's own fault
        with pytest.raises(ValueError, match=f"method '{method}' needs a cost model"):
            Server(tiny_target, drafter, method, MODEL)
    path = tmp_path / "cm.json"
    profile(tiny_target, drafter, max_nodes=8, contexts=(16,), repeats=1, progress=False).save(str(path))
    srv = Server(tiny_target, drafter, "condadaptive", MODEL, cost_model=str(path))
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 12}
    cfg, prompt, _, _ = srv.parse(body, chat=True)
    assert cfg.cost_model == str(path) and srv.parse({**body, "method": "ar"}, chat=True)[0].cost_model is None
    want = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=12).token_ids
    assert dt.generate(tiny_target, drafter, prompt, config=cfg).token_ids == want
