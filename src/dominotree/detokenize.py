"""Token ids to printable text a round at a time, for anything that streams (the CLI, the server)."""
from __future__ import annotations

REPLACEMENT = "\ufffd"   # what a decoder gives for the bytes of a character not yet complete
MAX_CHAR_TOKENS = 4      # a UTF-8 character has at most 4 bytes, so it spans at most 4 byte-level tokens


class IncrementalText:
    """The text of a growing list of token ids, handed out as it settles: never half a UTF-8
    character (byte-level tokenizers split emoji and CJK characters across tokens, and a round may
    end inside one), never a stop string or what follows it, and never the start of a stop string
    that may still complete. Each push decodes only the tokens since the last settled point (a
    4,096-token decode costs ~1.5 ms; once a round, that would grow with the answer).

    `push(ids)` returns the new text to show; `finish()` the rest once the ids are complete."""

    def __init__(self, decode, stop=()):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.ids: list[int] = []
        self.start = self.read = 0   # ids[:read] are settled; ids[start:read] give the next decode its context
        self.text = ""               # the text of ids[:read]
        self.shown = 0               # characters of it handed out
        self.stopped = False         # a stop string was found: nothing more is handed out

    def push(self, token_ids) -> str:
        self.ids.extend(int(t) for t in token_ids)
        self._settle(final=False)
        return self._release(final=False)

    def finish(self, final_text: str | None = None) -> str:
        """The rest of the text. `final_text`, the generation's own answer, settles where a stop
        string was cut (the cut may fall inside a token these ids still hold)."""
        shown = self.text[:self.shown]
        if final_text is not None and final_text.startswith(shown):
            self.stopped = True
            return final_text[len(shown):]
        self._settle(final=True)
        return self._release(final=True)

    def _settle(self, final: bool) -> None:
        end = len(self.ids)
        if end == self.read:
            return
        known = self.decode(self.ids[self.start:self.read]) if self.read > self.start else ""
        whole = self.decode(self.ids[self.start:end])
        # the last tokens may hold the first bytes of a character: settle up to the one before it
        for cut in range(end, max(self.read, end - MAX_CHAR_TOKENS), -1):
            window = whole if cut == end else self.decode(self.ids[self.start:cut])
            if final or not window.endswith(REPLACEMENT):
                self._take(window, known, cut)
                return
        # every end is a replacement (bytes no token completes, or a character's last byte shares
        # its token with such bytes): settle where no character is split, i.e. where the text
        # before the cut is the start of the whole decode, as far back as a character can begin
        for cut in range(end - MAX_CHAR_TOKENS, self.read, -1):
            window = self.decode(self.ids[self.start:cut])
            if whole.startswith(window):
                self._take(window, known, cut)
                return

    def _take(self, window: str, known: str, cut: int) -> None:
        # the window re-decodes ids[start:read], so that a tokenizer's leading-space rule sees the
        # same neighbours as in a whole decode; only what follows them is new
        self.text += window[len(known):]
        self.start, self.read = self.read, cut

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.text
        # a stop string never starts before `shown`: its start would have been held back
        found = [i for i in (text.find(s, self.shown) for s in self.stop) if i >= 0]
        if found:
            end, self.stopped = min(found), True
        elif final:
            end = len(text)
        else:
            end = len(text) - stop_prefix_len(text, self.stop, len(text) - self.shown)
        delta = text[self.shown:end]
        self.shown = max(self.shown, end)
        return delta


def stop_prefix_len(text: str, stop: list[str], limit: int) -> int:
    """Length of the longest end of `text` (at most `limit`) that some stop string begins with."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, limit), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
