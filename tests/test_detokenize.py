"""IncrementalText: streamed text equals the whole decode (split characters, invalid bytes), stop
strings are cut and never shown, not even their start."""
import random

import pytest

from dominotree.detokenize import REPLACEMENT, IncrementalText
from helpers import byte_level_tokenizer

TEXT = ("Grüße aus Köln! 你好，世界。こんにちは 🙂🚀 naïve café — «quotes»\n"
        "def f(x):\n    return x ** 2  # 二乘\nAnswer: 42 ✔️ 👩‍👩‍👧\n") * 3


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def stream(decode, ids, sizes, stop=()):
    inc, deltas, i = IncrementalText(decode, stop), [], 0
    for n in sizes:
        deltas.append(inc.push(ids[i:i + n]))
        i += n
    deltas.append(inc.push(ids[i:]))
    return deltas + [inc.finish()]


def splits(n, seed, most=12):
    rng = random.Random(seed)
    return [rng.randint(1, most) for _ in range(n)]


def test_the_text_splits_characters(tok):
    """The test text has rounds that end inside a character (the case the CLI once lost text on)."""
    ids = tok.encode(TEXT).ids
    assert sum(tok.decode(ids[:n]).endswith(REPLACEMENT) for n in range(len(ids))) >= 20


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_is_the_whole_decode(tok, seed):
    ids = tok.encode(TEXT).ids
    deltas = stream(tok.decode, ids, [1] * 40 if seed == 0 else splits(len(ids), seed))
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any(REPLACEMENT in d for d in deltas)          # no half character is ever shown


@pytest.mark.parametrize("seed", range(16))
def test_invalid_bytes_are_shown_as_the_decoder_shows_them(tok, seed):
    """A random token soup has bytes no token completes: streamed as a whole decode shows them,
    and never held back for good (every push after a few tokens shows something)."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, tok.get_vocab_size()) for _ in range(600)]
    assert REPLACEMENT in tok.decode(ids)
    deltas = stream(tok.decode, ids, splits(600, seed, most=3))
    assert "".join(deltas) == tok.decode(ids)
    inc, shown = IncrementalText(tok.decode), ""
    for i, t in enumerate(ids):
        shown += inc.push([t])
        assert len(tok.decode(ids[:i + 1])) - len(shown) <= 4 * 4   # at most a character's tokens held


def test_a_run_of_bytes_that_never_complete_is_not_held_for_good(tok):
    byte = next(t for t in range(tok.get_vocab_size()) if tok.decode([t]) == REPLACEMENT)
    inc, shown = IncrementalText(tok.decode), ""
    for n in range(1, 41):                    # one high byte repeated is never a character
        shown += inc.push([byte])
        assert len(shown) >= n - 4            # only the last 4 could still start one
    assert shown + inc.finish() == REPLACEMENT * 40


@pytest.mark.parametrize("stop", [["Answer:"], ["世界"], ["🚀"], ["x ** 2", "café"], ["\n    return"]])
@pytest.mark.parametrize("seed", range(4))
def test_a_stop_string_is_cut_and_never_shown(tok, stop, seed):
    ids = tok.encode(TEXT).ids
    deltas = stream(tok.decode, ids, [1] * 50 if seed == 0 else splits(len(ids), seed), stop=stop)
    cut = min(TEXT.find(s) for s in stop)
    assert "".join(deltas) == TEXT[:cut]


def test_the_start_of_a_stop_string_waits_for_the_rest(tok):
    inc = IncrementalText(tok.decode, ["Answer:"])
    assert inc.push(tok.encode("So the Ans").ids) == "So the "
    assert inc.push(tok.encode("we").ids) == ""                   # "Answe" may still become "Answer:"
    assert inc.push(tok.encode("red it").ids) == "Answered it"    # it did not
    assert inc.push(tok.encode(". Answ").ids) == ". "
    assert inc.finish() == "Answ"                                  # the end: nothing more can complete it
    assert not inc.stopped


def test_nothing_is_shown_after_a_stop_string(tok):
    inc = IncrementalText(tok.decode, ["world"])
    assert inc.push(tok.encode("Hello world and more").ids) == "Hello "
    assert inc.stopped
    assert inc.push(tok.encode(" text").ids) == "" and inc.finish() == ""
