"""Plain decoding (method "ar"): equals transformers' greedy generate; stop conditions; bad input."""
import pytest
import torch

import dominotree as dt

PROMPTS = [[1, 7, 8, 9], [1, 20, 21, 22, 23, 24, 25], [1, 50], [1, 4, 33, 60, 61, 62, 63, 64, 65, 66]]


def hf_greedy(target, prompt, n):
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                    pad_token_id=2, eos_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("which", ["tiny_target", "tiny_qwen3_target"])
def test_ar_greedy_equals_transformers_generate(which, request):
    target = request.getfixturevalue(which)
    for prompt in PROMPTS:
        ours = dt.generate(target, None, prompt, method="ar", max_new_tokens=40)
        assert ours.token_ids == hf_greedy(target, prompt, 40)
        assert ours.stats["finish_reason"] in ("stop", "length")
        assert ours.stats["tau"] == 1.0


def test_ar_stops_at_eos_and_reports_it(tiny_target):
    hits = 0
    for p in range(5, 90):
        r = dt.generate(tiny_target, None, [1, p], method="ar", max_new_tokens=30)
        if r.stats["finish_reason"] == "stop":
            assert r.token_ids[-1] == 2 and 2 not in r.token_ids[:-1]
            hits += 1
        else:
            assert len(r.token_ids) == 30
    assert hits > 0, "no prompt reached EOS: the EOS test does not exercise anything"


def test_sampling_is_seeded_and_private(tiny_target):
    # T = 5: the tiny target is so peaked (top token ~0.99999) that at T = 1 most seeds agree
    a = dt.generate(tiny_target, None, [1, 7, 8], method="ar", temperature=5.0, seed=3, max_new_tokens=20)
    torch.manual_seed(123)   # the global RNG must not matter
    b = dt.generate(tiny_target, None, [1, 7, 8], method="ar", temperature=5.0, seed=3, max_new_tokens=20)
    others = [dt.generate(tiny_target, None, [1, 7, 8], method="ar", temperature=5.0, seed=s,
                          max_new_tokens=20).token_ids for s in range(4, 9)]
    assert a.token_ids == b.token_ids
    assert all(o != a.token_ids for o in others)


def test_stop_strings_cut_the_text(tiny_target):
    prompt = next(p for p in ([1, k] for k in range(5, 90))
                  if len(dt.generate(tiny_target, None, p, method="ar", max_new_tokens=30).text.split()) > 6)
    full = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=30)
    words = full.text.split()
    stop = next(w for w in words[3:] if w not in words[:3])
    r = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=30, stop=[stop])
    assert r.stats["finish_reason"] == "stop"
    assert stop not in r.text
    assert full.text.startswith(r.text)


def test_a_stop_string_in_the_last_token_is_cut_too(tiny_target):
    """The round that reaches max_new_tokens (or EOS) used to end as 'length' with the stop string
    left in the text."""
    prompt = next(p for p in ([1, k] for k in range(5, 90))
                  if len(dt.generate(tiny_target, None, p, method="ar", max_new_tokens=30).text.split()) > 6)
    full = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=30)
    words = full.text.split()
    stop = next(w for w in words[3:] if w not in words[:3])
    last = next(n for n in range(1, 31) if stop in tiny_target.decode(full.token_ids[:n]))
    r = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=last, stop=[stop])
    assert r.stats["finish_reason"] == "stop" and stop not in r.text and full.text.startswith(r.text)


def test_chat_and_raw_prompts(tiny_target):
    chat = tiny_target.encode_prompt("hello world")
    raw = tiny_target.encode_prompt("hello world", raw=True)
    assert raw == [7, 8]
    assert chat[-2:] == [1, 5] and 7 in chat     # "<s>assistant" generation prompt
    msgs = tiny_target.encode_prompt([{"role": "user", "content": "hello"}])
    assert msgs[-2:] == [1, 5]


def test_context_limit(tiny_target):
    prompt = [1] + [10] * 250            # context is 256
    r = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=50)
    assert r.stats["finish_reason"] in ("context", "stop")
    assert len(prompt) + len(r.token_ids) <= 257


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=""), "empty prompt"),
    (dict(prompt="   "), "empty prompt"),
    (dict(prompt=[1] * 300), "context"),
    (dict(prompt=[]), "empty prompt"),
    (dict(prompt=[1, 10 ** 6]), "outside the target's vocabulary"),    # was an IndexError in the embedding
    (dict(prompt=[-1, 5]), "outside the target's vocabulary"),
    (dict(prompt=[{"role": "user"}]), "chat message 0 must be a dict"),  # was the template's UndefinedError
    (dict(prompt=[{"role": "user", "content": "hi"}, 5]), "chat message 1"),
    (dict(prompt=["hi", "there"]), "chat message 0"),
    (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=[1, 2], max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt=[1, 2], method="beam"), "unknown method"),
    (dict(prompt=[1, 2], method="dominotree"), "needs a drafter"),
    (dict(prompt=[1, 2], temperature=-1), "temperature"),
    (dict(prompt=[1, 2], temperature=float("nan")), "temperature"),
    (dict(prompt=[1, 2], temperature=float("inf")), "temperature"),
    (dict(prompt=[1, 2], top_p=0), "top_p"),
    (dict(prompt=[1, 2], stop=[""]), "non-empty strings"),     # would match at once: an empty answer
    (dict(prompt=[1, 2], stop=["a", 3]), "non-empty strings"),
    (dict(prompt=[1, 2], seed=2 ** 70), "seed"),               # torch's own error named no option
    (dict(prompt=[1, 2], seed=1.5), "seed"),
    (dict(prompt=[1, 2], max_depth=0), "max_depth must be"),        # drafted nothing: tau 1, silently
    (dict(prompt=[1, 2], max_depth=-1), "max_depth must be"),       # a std::vector error in the Domino chain
])
def test_bad_input_gets_a_clear_error(tiny_target, kwargs, match):
    kwargs = {"method": "ar", **kwargs}
    with pytest.raises(ValueError, match=match):
        dt.generate(tiny_target, None, **kwargs)
    # the target is still usable afterwards
    assert dt.generate(tiny_target, None, [1, 7], method="ar", max_new_tokens=3).token_ids


@pytest.mark.parametrize("prompt", [None, 123, torch.tensor([1, 2])])
def test_a_prompt_of_another_type_is_a_type_error(tiny_target, prompt):
    with pytest.raises(TypeError, match="a prompt is a string, a list of chat messages or a list of token ids"):
        dt.generate(tiny_target, None, prompt, method="ar")


def test_a_prompt_passed_as_the_drafter_is_explained(tiny_target):
    with pytest.raises(TypeError, match="pass the prompt third"):
        dt.generate(tiny_target, "hello world", method="ar")


def test_token_ids_may_be_numpy_integers(tiny_target):
    import numpy as np
    ids = [1, 7, 8]
    assert dt.generate(tiny_target, None, list(np.array(ids)), method="ar", max_new_tokens=5).token_ids == \
        dt.generate(tiny_target, None, ids, method="ar", max_new_tokens=5).token_ids


def test_a_second_generation_on_a_busy_target_is_refused_and_the_first_goes_on(tiny_target):
    """Both would share the target's one KV cache: interleaving them corrupted both (a TypeError
    deep in a round); now the second is refused and the first's tokens are unchanged."""
    want = dt.generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=20).token_ids
    first = iter(dt.stream_generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=20))
    got = next(first).token_ids + next(first).token_ids
    with pytest.raises(RuntimeError, match="in the middle of another generation"):
        dt.generate(tiny_target, None, [1, 50], method="ar", max_new_tokens=5)
    got += [t for event in first for t in event.token_ids]
    assert got == want
    # a stream left by `break` or closed frees the target at once
    for _ in dt.stream_generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=20):
        break
    stream = dt.stream_generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=20)
    next(iter(stream))
    stream.close()
    assert dt.generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=20).token_ids == want


def test_a_stream_generates_once_however_often_it_is_iterated(tiny_target):
    want = dt.generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=12, temperature=1.0, seed=4)
    stream = dt.stream_generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=12, temperature=1.0, seed=4)
    rounds = iter(stream)
    first = next(rounds).token_ids
    rest = [t for ev in stream for t in ev.token_ids]       # a second loop goes on where the first stopped
    assert first + rest == want.token_ids == stream.result.token_ids
    result = stream.result
    assert list(stream) == [] and stream.result is result     # not a second generation replacing the result
    # a loop left early (or close()) ends the generation: looping again is refused, not a fresh start
    for left in ("break", "close", "close first"):
        early = dt.stream_generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=12)
        if left == "close first":           # closed before it started: it never starts
            early.close()
        else:
            for _ in early:
                break
        if left == "close":
            early.close()
        with pytest.raises(RuntimeError, match="generation was stopped"):
            list(early)
        assert early.result is None


def test_two_threads_on_one_target_never_mix_their_caches(tiny_target):
    import threading
    want = dt.generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=30).token_ids
    outcomes = []

    def work():
        try:
            outcomes.append(dt.generate(tiny_target, None, [1, 7, 8], method="ar", max_new_tokens=30).token_ids)
        except RuntimeError as e:
            outcomes.append(str(e))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(o == want or "another generation" in o for o in outcomes) and want in outcomes


def test_a_spec_config_is_a_base_that_options_override(tiny_target):
    from conftest import random_drafter
    tiny_domino = random_drafter(True, seed=2)
    cfg = dt.SpecConfig(method="ddtree", budget=6, max_new_tokens=14, stop=["w50"])
    base = dt.generate(tiny_target, tiny_domino, [5, 6, 7], config=cfg)
    assert base.stats["method"] == "ddtree" and len(base.token_ids) <= 14
    assert base.token_ids == dt.generate(tiny_target, tiny_domino, [5, 6, 7], method="ddtree", budget=6,
                                         max_new_tokens=14, stop=["w50"]).token_ids
    over = dt.generate(tiny_target, tiny_domino, [5, 6, 7], "dominotree", config=cfg, max_new_tokens=20)
    assert over.stats["method"] == "dominotree" and over.token_ids[:len(base.token_ids)] == base.token_ids
    streamed = [t for ev in dt.stream_generate(tiny_target, tiny_domino, [5, 6, 7], config=cfg) for t in ev.token_ids]
    assert streamed == base.token_ids
    assert cfg.method == "ddtree" and cfg.max_new_tokens == 14 and cfg.stop == ["w50"]    # left as it was
    with pytest.raises(ValueError, match="budget"):        # an override is checked like any option
        dt.generate(tiny_target, tiny_domino, [5, 6, 7], config=cfg, budget=0)
    with pytest.raises(TypeError, match="config must be a dominotree.SpecConfig"):
        dt.generate(tiny_target, tiny_domino, [5, 6, 7], config={"method": "ar"})


@pytest.mark.parametrize("bad, match", [
    ({"top_k": 2.5}, "top_k must be an integer"), ({"budget": True}, "budget must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"), ({"node_topk": 2.5}, "node_topk"),
    ({"corr_topm": 2.5}, "corr_topm must be an integer or None"), ({"temperature": "0.5"}, "temperature must be a number"),
    ({"raw": "yes"}, "raw must be True or False"), ({"cost_model": 5}, "cost_model must be a path"),
    ({"draft_vocab": True}, "draft_vocab must be an integer"),
])
def test_option_types_are_checked_before_their_ranges(bad, match):
    with pytest.raises(ValueError, match=match):
        dt.SpecConfig(method="dominotree", **bad)


def test_numpy_scalars_are_accepted_as_their_python_values():
    import numpy as np
    cfg = dt.SpecConfig(method="dominotree", budget=np.int64(8), seed=np.int32(3), temperature=np.float32(0.5))
    assert (cfg.budget, cfg.seed, cfg.temperature) == (8, 3, 0.5)
    assert type(cfg.budget) is int and type(cfg.seed) is int and type(cfg.temperature) is float


def test_unknown_option_is_rejected(tiny_target):
    with pytest.raises(TypeError, match="unknown generation option"):
        dt.generate(tiny_target, None, [1, 2], method="ar", max_tokens=5)


def test_unknown_model_name():
    with pytest.raises(dt.ModelNotFoundError, match="unknown model"):
        dt.load_target("no-such-model")


def _hub_cache_entry(cache, repo_id, files_from):
    """A Hugging Face cache holding one snapshot of repo_id (the layout huggingface_hub writes)."""
    import shutil
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(files_from, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")


def test_hub_ids_load_from_the_hugging_face_cache_offline(tiny_llama_dir, ckpt_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants
    cache = tmp_path / "hub"
    drafter_dir, _ = ckpt_dir(True)
    _hub_cache_entry(cache, "someone/tiny-llama", tiny_llama_dir)
    _hub_cache_entry(cache, "someone/tiny-domino", drafter_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = dt.load_target("someone/tiny-llama", dtype=torch.float32)
    drafter = dt.load_drafter("someone/tiny-domino", target=target)
    want = dt.generate(dt.load_target(str(tiny_llama_dir), dtype=torch.float32), None, [5, 6, 7], method="ar",
                       max_new_tokens=12).token_ids
    assert dt.generate(target, drafter, [5, 6, 7], method="dominotree", max_new_tokens=12).token_ids == want
    # an id the cache lacks: offline, one clear error (no download tried); a path that exists stays a path
    for name, load in (("someone/absent", dt.load_target), ("someone/absent-drafter", dt.load_drafter)):
        with pytest.raises(dt.ModelNotFoundError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
            load(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "someone" / "tiny-llama").mkdir(parents=True)
    with pytest.raises(dt.ModelNotFoundError, match="has no config.json"):
        dt.load_target("someone/tiny-llama")
