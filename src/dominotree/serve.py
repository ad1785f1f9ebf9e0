"""OpenAI-compatible HTTP server: /v1/chat/completions and /v1/completions (with SSE streaming),
/v1/models, /health, and a small demo page at / that highlights accepted draft tokens.

One model is shared by all requests. Requests take turns on an asyncio lock, and every call into
the model or tokenizer runs on one worker thread, round by round, so the event loop stays
responsive. A client that goes away mid-stream just stops the iteration: the generation stream's
close runs on the same worker thread (its finally-block rolls the target back) before the next
request's work."""
from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from html import escape

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import dominotree as dt
from dominotree.config import ADAPTIVE_METHODS
from dominotree.detokenize import IncrementalText
from dominotree.draft_vocab import draft_vocab_for
from dominotree.trees.datastore import store_for

DEFAULT_MAX_TOKENS = 256


class APIError(Exception):
    """An error the client caused (or, status 500, one it did not), sent as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_KINDS = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
}


def _field(body: dict, name: str, kind: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not _KINDS[kind](value):
        raise APIError(400, f"'{name}' must be {'an' if kind[0] in 'aeio' else 'a'} {kind}, got "
                            f"{json.dumps(value)[:60]}", name, "invalid_type")
    return value


# Options that would change what is generated (or returned) and that this server does not
# implement: refused unless at their no-op value, so a client never silently gets other output.
UNSUPPORTED = {"logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
               "repetition_penalty": (1,), "logit_bias": ({},), "best_of": (1,), "echo": (False,),
               "suffix": ("",), "tools": ([],), "response_format": ({"type": "text"},)}


def _refuse_unsupported(body: dict) -> None:
    for name, no_ops in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in no_ops:
            raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _top_k(body: dict) -> int:
    """`top_k` as vLLM and SGLang take it (not OpenAI's): 0 or their -1 leave it off."""
    top_k = _field(body, "top_k", "integer", 0)
    return 0 if top_k == -1 else top_k


def _message_text(m, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"messages[{i}] must be an object with a string 'role'", "messages", "invalid_type")
    content = m.get("content")
    if isinstance(content, list):   # content parts: text only (an image dropped would be answered as unseen)
        if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
            raise APIError(400, f"messages[{i}].content parts must be objects", "messages", "invalid_type")
        other = sorted({str(p.get("type")) for p in content if p.get("type", "text") != "text"})
        if other:
            raise APIError(400, f"messages[{i}].content: this text model takes text parts only, not {', '.join(other)}",
                           "messages", "invalid_value")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages",
                       "invalid_type")
    return {"role": m["role"], "content": content}


def _event(obj) -> str:
    """One Server-Sent Event carrying a JSON object."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Run:
    """One generation's state on the worker thread: its text as it settles (never a stop string,
    nor half a character) and live speculation counters."""

    def __init__(self, target, stream: dt.GenerationStream):
        self.stream, self.it = stream, iter(stream)
        self.text = IncrementalText(target.decode, stream.cfg.stop)
        self.tokens = self.events = self.accepted = 0
        self.t0 = time.perf_counter()

    def step(self) -> dict | None:
        """Advance one round (worker thread); None once the stream is exhausted."""
        ev = next(self.it, None)
        if ev is None:
            return None
        self.events += 1
        self.accepted += ev.accepted
        self.tokens += len(ev.token_ids)
        k = min(ev.accepted, len(ev.token_ids))   # the first k tokens were drafted and accepted
        drafted = self.text.push(ev.token_ids[:k])
        delta = drafted + self.text.push(ev.token_ids[k:])
        rounds = self.events - 1                # the first event is the prefill's token
        return {"delta": delta, "spec": {
            "accepted": ev.accepted, "round_tokens": len(ev.token_ids), "draft_chars": len(drafted),
            "tokens": self.tokens, "rounds": rounds,
            "tau": (self.accepted + rounds) / rounds if rounds else 1.0,
            "tokens_per_second": self.tokens / max(time.perf_counter() - self.t0, 1e-9)}}

    def finish(self) -> str:
        """The rest of the text once the stream is exhausted."""
        return self.text.finish(self.stream.result.text)


class Server:
    def __init__(self, target, drafter, method: str, model_name: str, lookup: int = 0,
                 lookup_store: str | None = None, draft_vocab: int = 0, draft_vocab_source: str = "train-data",
                 cost_model: str | None = None):
        if method not in dt.METHODS:
            raise ValueError(f"unknown method {method!r}")
        if method != "ar" and drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        cfg = dt.SpecConfig(method=method, lookup=lookup, lookup_store=lookup_store,   # bad server-wide options
                            draft_vocab=draft_vocab, draft_vocab_source=draft_vocab_source,   # fail at start-up
                            cost_model=cost_model)
        if method in ADAPTIVE_METHODS:   # not a 400 on every request: a missing cost model is the server's
            from .trees.builders import load_cost_model
            load_cost_model(cfg, target)
        if lookup_store is not None:
            store_for(lookup_store, target.name)
        if draft_vocab:
            draft_vocab_for(target, draft_vocab, draft_vocab_source)
        if method in ("domino", "dominotree", "condadaptive"):
            from .trees import native
            native.load()   # compile the native library (first run only) here, not inside a request
        from . import tree_attention
        tree_attention.enabled(target.dtype)    # and the attention kernel of verifies and steps, where this CPU uses it
        self.target, self.drafter, self.method, self.model_name = target, drafter, method, model_name
        self.lookup, self.lookup_store = lookup, lookup_store
        self.draft_vocab, self.draft_vocab_source = draft_vocab, draft_vocab_source
        self.cost_model = cost_model
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dominotree-model")
        self.lock = asyncio.Lock()
        self.created = int(time.time())

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- request parsing -----------------------------------------------------------------------
    def parse(self, body, chat: bool):
        """(SpecConfig, prompt, stream?, include_usage?) or an APIError."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        if _field(body, "n", "integer", 1) != 1:
            raise APIError(400, "only n=1 is supported", "n", "invalid_value")
        _refuse_unsupported(body)
        method = _field(body, "method", "string", self.method)
        if method not in (self.method, "ar"):
            raise APIError(400, f"method must be {self.method!r} or 'ar', got {method!r}", "method", "invalid_value")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a string or a list of non-empty strings", "stop", "invalid_type")
        max_tokens = _field(body, "max_completion_tokens", "integer")
        max_tokens = _field(body, "max_tokens", "integer", DEFAULT_MAX_TOKENS) if max_tokens is None else max_tokens
        temperature = _field(body, "temperature", "number", 1.0)
        if not 0 <= temperature <= 2:
            raise APIError(400, f"temperature must be between 0 and 2, got {temperature}", "temperature",
                           "invalid_value")
        seed = _field(body, "seed", "integer")    # its range: SpecConfig's
        stream = _field(body, "stream", "boolean", False)
        include_usage = bool(_field(_field(body, "stream_options", "object", {}), "include_usage", "boolean"))
        try:
            cfg = dt.SpecConfig(method=method, max_new_tokens=max_tokens, temperature=float(temperature),
                                top_p=float(_field(body, "top_p", "number", 1.0)),
                                top_k=_top_k(body), seed=seed, stop=stop, raw=not chat,
                                lookup=0 if method == "ar" else self.lookup,
                                lookup_store=None if method == "ar" else self.lookup_store,
                                draft_vocab=0 if method == "ar" else self.draft_vocab,
                                draft_vocab_source=self.draft_vocab_source,
                                cost_model=None if method == "ar" else self.cost_model)
        except ValueError as e:
            param = str(e).split()[0].replace("max_new_tokens", "max_tokens")
            raise APIError(400, str(e).replace("max_new_tokens", "max_tokens"), param, "invalid_value") from None
        return cfg, self._prompt(body, chat), stream, include_usage

    def _prompt(self, body: dict, chat: bool):
        name = "messages" if chat else "prompt"
        value = body.get(name)
        if value is None:
            raise APIError(400, f"'{name}' is required", name, "missing_required_parameter")
        if chat:
            if not isinstance(value, list) or not value:
                raise APIError(400, "'messages' must be a non-empty array", name, "invalid_type")
            return [_message_text(m, i) for i, m in enumerate(value)]
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]                    # a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if not all(0 <= t < self.target.vocab_size for t in value):
                raise APIError(400, "prompt token ids must lie in the vocabulary", name, "invalid_value")
            return value
        raise APIError(400, "'prompt' must be a string or a list of token ids", name, "invalid_type")

    async def encode(self, prompt, cfg, param: str) -> list[int]:
        try:
            ids = await self.call(self.target.encode_prompt, prompt, cfg.raw)
        except ValueError as e:
            raise APIError(400, str(e), param, "invalid_value") from None
        if not ids:
            raise APIError(400, "empty prompt", param, "invalid_value")
        if len(ids) + 1 > self.target.max_context:
            raise APIError(400, f"this model's maximum context length is {self.target.max_context} tokens; "
                                f"the prompt has {len(ids)}", param, "context_length_exceeded")
        return ids

    # ---- generation ----------------------------------------------------------------------------
    async def rounds(self, ids: list[int], cfg):
        """Async generator of per-round dicts {delta, spec}; the last one also has the result."""
        async with self.lock:
            drafter = None if cfg.method == "ar" else self.drafter
            stream = await self.call(dt.GenerationStream, self.target, drafter, ids, cfg)
            run = _Run(self.target, stream)
            try:
                while (info := await self.call(run.step)) is not None:
                    yield info
            finally:   # no await here: a cancelled client must not leave the lock held
                self.pool.submit(run.it.close)
            yield {"delta": run.finish(), "result": stream.result}

    def spec(self, result) -> dict:
        s = result.stats
        return {"method": s["method"], "tau": s["tau"], "rounds": s["rounds"],
                "tokens_per_second": s["tokens_per_second"], "finish_reason": s["finish_reason"]}

    @staticmethod
    def finish_reason(result) -> str:
        return "stop" if result.stats["finish_reason"] == "stop" else "length"

    @staticmethod
    def usage(ids, result) -> dict:
        n = len(result.token_ids)
        return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

    async def complete(self, request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        cfg, prompt, stream, include_usage = self.parse(body, chat)
        ids = await self.encode(prompt, cfg, "messages" if chat else "prompt")
        gen = self.rounds(ids, cfg)
        try:
            first = await anext(gen)            # errors before any output still get a status code
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if stream:
            return StreamingResponse(self.sse(head, first, gen, chat, ids, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        info = first
        async for info in gen:
            pass
        result = info["result"]
        fr = self.finish_reason(result)
        choice = ({"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                   "finish_reason": fr} if chat else
                  {"index": 0, "text": result.text, "logprobs": None, "finish_reason": fr})
        return JSONResponse({**head, "choices": [choice], "usage": self.usage(ids, result),
                             "spec": self.spec(result)})

    async def sse(self, head, first, gen, chat, ids, include_usage):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text, finish=None, spec=None, role=False):
            if not chat:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            else:
                delta = {"content": text} if text or not finish else {}
                delta = {"role": "assistant", **delta} if role else delta
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return _event({**head, "choices": [choice], **({"spec": spec} if spec else {})})

        try:
            if chat:
                yield chunk("", role=True)
            info = first
            while "result" not in info:
                yield chunk(info["delta"], spec=info["spec"])
                info = await anext(gen)
            result = info["result"]
            yield chunk(info["delta"], self.finish_reason(result), self.spec(result))
            if include_usage:
                yield _event({**head, "choices": [], "usage": self.usage(ids, result)})
        except Exception as e:                 # headers are sent: report in-band
            err = APIError(500, f"generation failed: {e}", type_="server_error")
            yield _event(err.body())
        finally:   # a client gone mid-send: let the round generator release the lock now
            await gen.aclose()
        yield "data: [DONE]\n\n"

    def page(self) -> str:
        methods = [self.method] + (["ar"] if self.method != "ar" else [])
        options = "".join(f'<option value="{m}">{m}{" (plain decoding)" if m == "ar" else " (speculative)"}</option>'
                          for m in methods)
        return PAGE.replace("__MODEL__", escape(self.model_name)).replace("__OPTIONS__", options)


def create_app(target, drafter, method: str = "dominotree", model_name: str | None = None,
               lookup: int = 0, lookup_store: str | None = None, draft_vocab: int = 0,
               draft_vocab_source: str = "train-data", cost_model: str | None = None) -> FastAPI:
    """The ASGI app serving `target` (+ `drafter`) with `method` (and a prompt-lookup branch of
    `lookup` tokens, 0: none, plus a datastore branch from `lookup_store`; a drafter LM head over the
    `draft_vocab` tokens the target writes most in `draft_vocab_source`, 0: all) under the name `model_name`;
    `cost_model`: the CaDDTree/CondAdaptive cost model (None: the cached one), loaded at start-up."""
    srv = Server(target, drafter, method, model_name or str(target.name), lookup, lookup_store, draft_vocab,
                 draft_vocab_source, cost_model)
    app = FastAPI(title="dominotree", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await srv.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.complete(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": srv.model_name, "object": "model", "created": srv.created,
                                            "owned_by": "dominotree"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": srv.model_name, "method": srv.method, "busy": srv.lock.locked()}

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return srv.page()

    return app


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is one clear error at once."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be 0-65535, got {port}")
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def main(args) -> int:
    import uvicorn
    sock = _listen(args.host, args.port)
    dt.SpecConfig(method=args.method, lookup=args.lookup, lookup_store=args.lookup_store,   # bad flags: before
                  draft_vocab=args.draft_vocab, draft_vocab_source=args.draft_vocab_source,   # the models load
                  cost_model=args.cost_model)
    if args.method != "ar" and args.drafter is None:
        dflash = args.method in ("dflash", "ddtree", "caddtree")   # the same defaults as `generate`
        args.drafter = "smollm2-135m-dflash" if dflash else "smollm2-135m-domino"
    pack = not args.no_pack
    target = dt.load_target(args.model, dtype=args.dtype, pack=pack, gqa=not args.no_gqa,
                            lean=not args.no_lean_target)
    drafter = None if args.method == "ar" else dt.load_drafter(args.drafter, target=target, pack=pack)
    name = os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model
    app = create_app(target, drafter, args.method, name, lookup=args.lookup, lookup_store=args.lookup_store,
                     draft_vocab=args.draft_vocab, draft_vocab_source=args.draft_vocab_source,
                     cost_model=args.cost_model)
    print(f"dominotree: serving {name} with {args.method} on http://{args.host}:{args.port}/", file=sys.stderr)
    uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
    return 0


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>dominotree</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:860px;margin:2em auto;padding:0 1em;color:#222}
textarea{width:100%;height:6em;font:inherit;box-sizing:border-box}
.row{display:flex;gap:1em;align-items:center;flex-wrap:wrap;margin:.6em 0}
input{width:5em}
#out{white-space:pre-wrap;border:1px solid #ccc;border-radius:6px;padding:.8em;min-height:6em}
.d{background:#bfeebf}
#stats,#status,.legend{color:#555;font-size:13px}
</style></head><body>
<h2>dominotree <small style="color:#777">__MODEL__</small></h2>
<textarea id="prompt" placeholder="Ask something"></textarea>
<div class="row">
<label>method <select id="method">__OPTIONS__</select></label>
<label>temperature <input id="temp" type="number" value="0" min="0" max="2" step="0.1"></label>
<label>max tokens <input id="max" type="number" value="256" min="1"></label>
<button id="go">Generate</button>
</div>
<div id="stats">&nbsp;</div>
<div id="out"></div>
<p class="legend"><span class="d">accepted draft tokens</span> &middot; tokens from the target</p>
<div id="status">idle</div>
<script>
const $ = id => document.getElementById(id);
function add(text, cls) {
  if (!text) return;
  const s = document.createElement('span');
  if (cls) s.className = cls;
  s.textContent = text;
  $('out').appendChild(s);
}
function show(s) {
  if (s.tau === undefined) return;
  $('stats').textContent =
    `${s.tokens_per_second.toFixed(1)} tok/s \\u00b7 tau ${s.tau.toFixed(2)} \\u00b7 ${s.rounds} rounds`;
}
async function run() {
  $('out').textContent = ''; $('go').disabled = true; $('status').textContent = 'running';
  const body = {messages: [{role: 'user', content: $('prompt').value}], stream: true, method: $('method').value,
                temperature: +$('temp').value, max_tokens: +$('max').value};
  try {
    const r = await fetch('/v1/chat/completions', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                                   body: JSON.stringify(body)});
    if (!r.ok) throw new Error((await r.json()).error.message);
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = '', i;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      while ((i = buf.indexOf('\\n\\n')) >= 0) {
        const line = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
        const c = JSON.parse(line.slice(6));
        if (c.error) throw new Error(c.error.message);
        const text = (c.choices[0] && c.choices[0].delta.content) || '', s = c.spec || {};
        const k = Math.min(s.draft_chars || 0, text.length);
        add(text.slice(0, k), 'd'); add(text.slice(k), '');
        show(s);
      }
    }
    $('status').textContent = 'done';
  } catch (e) { $('status').textContent = 'error: ' + e.message; }
  $('go').disabled = false;
}
$('go').onclick = run;
const q = new URLSearchParams(location.search);
if (q.get('prompt')) $('prompt').value = q.get('prompt');
if (q.get('method')) $('method').value = q.get('method');
if (q.get('temperature')) $('temp').value = q.get('temperature');
if (q.get('max')) $('max').value = q.get('max');
if (q.get('autorun') === '1') run();
</script></body></html>
"""
