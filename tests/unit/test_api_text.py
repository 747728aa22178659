"""Incremental detokenization and stop strings, on the real byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from tetri_server.api.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    StopMatcher,
    StreamDetokenizer,
    make_detokenizer,
)

PROMPT = [1, 500, 600]


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir("llama", "tiny")))


@pytest.fixture(params=[IncrementalDetokenizer, StreamDetokenizer])
def detok(request):
    return request.param


def _stream(tok, ids: list[int], cls=IncrementalDetokenizer) -> list[str]:
    d = cls(tok, PROMPT)
    return [d.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_a_fast_tokenizer_gets_the_decode_stream(tok) -> None:
    assert isinstance(make_detokenizer(tok, PROMPT), StreamDetokenizer)

    class Slow:  # no tokenizers backend: the Python detokenizer
        def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001, ANN202, ARG002
            return "".join(chr(65 + i % 26) for i in ids)

    assert isinstance(make_detokenizer(Slow(), PROMPT), IncrementalDetokenizer)


def test_a_long_undecodable_run_is_sent_as_replacement_characters(tok, detok) -> None:
    partial = [i for i in range(len(tok)) if REPLACEMENT in tok.decode([i])]
    lone = next(t for t in partial if REPLACEMENT in tok.decode([t, t, t, t]))
    ids = [lone] * 100 + tok.encode(" ok", add_special_tokens=False)
    pieces = _stream(tok, ids, detok)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert any(REPLACEMENT in p for p in pieces[:-2])  # not all held to the end


def test_multibyte_characters_split_across_tokens_are_never_sent_broken(tok, detok) -> None:
    text = "Hi 😀 wörld — 你好世界 🎉🎉 naïve café ½"
    ids = tok.encode(text, add_special_tokens=False)
    split = [t for t in ids if REPLACEMENT in tok.decode([t])]
    assert len(split) >= 4, "the test needs tokens that hold part of a character"
    pieces = _stream(tok, ids, detok)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in p for p in pieces)
    assert "" in pieces  # something was held back


def test_random_tokens_join_to_the_full_decode(tok, detok) -> None:
    partial = [i for i in range(len(tok)) if REPLACEMENT in tok.decode([i])]
    rng = random.Random(0)
    for _ in range(200):
        ids = [
            rng.choice(partial) if rng.random() < 0.5 else rng.randrange(5, len(tok))
            for _ in range(30)
        ]
        assert "".join(_stream(tok, ids, detok)) == tok.decode(
            ids, skip_special_tokens=True).rstrip(REPLACEMENT)  # a cut character: not sent


def test_an_output_cut_within_a_character_ends_before_it(tok, detok) -> None:
    """max_tokens reached inside a multi-byte character: the broken character is not sent
    (vLLM holds it back to the end too). It was sent as U+FFFD at the end of the reply."""
    ids = tok.encode("héllo 😀 日本語", add_special_tokens=False)
    cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT)]
    assert len(cuts) >= 3, "the test needs cuts that fall inside a character"
    for n in cuts:
        text = "".join(_stream(tok, ids[:n], detok))
        assert REPLACEMENT not in text and text == tok.decode(ids[:n]).rstrip(REPLACEMENT)


def test_a_prompt_that_ends_inside_a_character_is_not_repeated_in_the_output(
        tok, detok) -> None:
    """Regression (review of session 62): a prompt given as token ids that ends inside a
    multi-byte character made the decode stream send its whole context (up to 5 prompt
    tokens of text) with the output token that completed the character, HTTP 200; the Python
    detokenizer dropped the completed character instead. The output is the full text less
    what the prompt shows, at every cut."""
    for text in ("Say 你好世界 now", "héllo 😀 日本語 ½", "a 🎉🎉 b — c"):
        ids = tok.encode(text, add_special_tokens=False)
        cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT)]
        assert cuts, "the test needs prompts that end inside a character"
        for n in range(1, len(ids)):
            d = detok(tok, ids[:n])
            got = "".join(d.add([t]) for t in ids[n:]) + d.add([], final=True)
            shown = tok.decode(ids[:n]).rstrip(REPLACEMENT)
            assert shown + got == text, (text, n, got)


def test_a_prompt_of_random_token_ids_gives_only_what_its_output_adds(tok, detok) -> None:
    """Token-id prompts that end in bytes which no output completes (a lone continuation byte)
    or in part of a character: the output text is the full decode less the prompt's text as
    far as the output left it unchanged, never a U+FFFD the prompt already showed."""
    partial = [i for i in range(len(tok)) if REPLACEMENT in tok.decode([i])]
    lone = next(t for t in partial if tok.decode([t, t]) == REPLACEMENT * 2)
    ok = tok.encode(" ok", add_special_tokens=False)
    for detok_prompt in ([500, lone], [500, lone, lone, lone, lone]):
        d = detok(tok, detok_prompt)
        assert "".join(d.add([t]) for t in ok) + d.add([], final=True) == " ok"
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.choice(partial) if rng.random() < 0.6 else rng.randrange(5, len(tok))
                  for _ in range(6)]
        out = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(5, len(tok))
               for _ in range(8)]
        d = detok(tok, prompt)
        got = "".join(d.add([t]) for t in out) + d.add([], final=True)
        full = tok.decode(prompt + out).rstrip(REPLACEMENT)
        shown = tok.decode(prompt)
        assert full.endswith(got)
        # before it: the prompt's text, a character broken at its end completed or not
        head = full[:len(full) - len(got)]
        assert head == shown or (head.startswith(shown.rstrip(REPLACEMENT))
                                 and shown.startswith(head)), (prompt, out, got)


def test_a_prompt_given_as_text_that_ends_in_a_replacement_character_keeps_it(
        tok, detok) -> None:
    """A U+FFFD at the end of a text prompt is the prompt's own character, not part of one the
    output completes: nothing of it comes again in the output (review of session 62)."""
    prompt = tok.encode("odd \ufffd", add_special_tokens=False)
    assert tok.decode(prompt).endswith(REPLACEMENT)
    out = tok.encode(" ok", add_special_tokens=False)
    d = detok(tok, prompt)
    assert "".join(d.add([t]) for t in out) + d.add([], final=True) == " ok"


def sentencepiece_style():  # noqa: ANN201 - a PreTrainedTokenizerFast
    """A tiny Llama-2-style tokenizer: ``▁`` for spaces, ``<0xXX>`` byte tokens, a decoder
    that strips the leading space of a decode, and one added special token (the last id)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for w in ("▁", "▁the", "a"):
        vocab[w] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    sp = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    sp.add_special_tokens({"additional_special_tokens": ["<|x|>"]})
    return sp, vocab


def test_a_skipped_special_token_keeps_the_next_words_space(detok) -> None:
    """Regression (review of session 62): after a chunk that decodes to nothing (a special
    token skipped), the Python detokenizer decoded the next chunk with that token alone as
    left context, and a SentencePiece decoder dropped the next word's leading space."""
    sp, vocab = sentencepiece_style()
    special = len(sp) - 1
    d = detok(sp, [1, vocab["a"]])
    ids = [special, vocab["▁"], 3 + 0xC3, 3 + 0xA9, vocab["▁the"]]
    got = "".join(d.add([t]) for t in ids) + d.add([], final=True)
    assert got == " é the"


def test_a_byte_that_takes_back_a_sent_character_is_no_crash(detok) -> None:
    """Regression (session 66 review): with a byte-fallback tokenizer (Llama 2, Mistral), a
    stray continuation byte after a sent "é" makes the whole byte run decode as U+FFFD, and
    ``DecodeStream.step`` raised "Invalid prefix encountered": the request was a 500 (or a
    stream cut by an error). The text goes on from what was sent, the byte as U+FFFD."""
    sp, vocab = sentencepiece_style()
    c3, a9 = 3 + 0xC3, 3 + 0xA9
    d = detok(sp, [1, vocab["a"]])
    ids = [vocab["▁"], c3, a9, a9, vocab["▁the"]]
    pieces = [d.add([t]) for t in ids] + [d.add([], final=True)]
    assert "".join(pieces[:3]) == " é"
    assert "".join(pieces).startswith(" é") and "".join(pieces).endswith(" the")
    assert REPLACEMENT in "".join(pieces)
    # a prompt given as token ids that ends in such bytes, then any output token
    d = detok(sp, [1, vocab["a"], c3, a9, a9])
    assert (d.add([vocab["▁the"]]) + d.add([], final=True)).endswith(" the")


def test_special_tokens_are_skipped_and_leading_space_kept(tok, detok) -> None:
    ids = tok.encode(" hello there", add_special_tokens=False)
    eos = tok.eos_token_id
    pieces = _stream(tok, [*ids[:1], eos, *ids[1:], eos], detok)
    assert "".join(pieces) == " hello there"


def test_stop_string_split_across_pieces_is_cut_and_never_sent() -> None:
    m = StopMatcher(("STOP", "xyz"))
    sent = []
    for piece in ["Hello S", "TO", "P! more"]:
        out, matched = m.feed(piece)
        sent.append(out)
        if matched:
            break
    assert matched and "".join(sent) == "Hello "
    assert "S" not in "".join(sent[:2])  # the prefix of the stop string was held back


def test_stop_matcher_flushes_held_text_at_the_end_and_picks_the_earliest() -> None:
    m = StopMatcher(("abcd",))
    assert m.feed("xxab") == ("x", False)
    assert m.feed("c", final=True) == ("xabc", False)
    m = StopMatcher(("lo", "he"))
    assert m.feed("say hello") == ("say ", True)
    assert StopMatcher(()).feed("anything") == ("anything", False)


def test_no_stop_string_ends_within_the_min_tokens_text() -> None:
    """min_tokens: vLLM matches no stop string that ends within the text of the first
    min_tokens tokens (``min_end``); one that ends beyond it matches, even if it starts
    inside."""
    m = StopMatcher(("ab",))
    m.min_end = 6
    assert m.feed("xxab") == ("xxa", False)  # "ab" ends at 4 <= 6: no match, "b" held
    assert m.feed("yya") == ("byy", False)
    assert m.feed("b!") == ("", True)  # "ab" at 6..8 ends past 6: the text ends at 6
    m = StopMatcher(("ab",))
    m.min_end = 5
    assert m.feed("xxxxabz") == ("xxxx", True)  # starts at 4, ends at 6 > 5


def test_the_stop_string_that_completes_first_wins_however_the_text_arrives() -> None:
    """Regression: with several matches in one piece the earliest start won, so the reply
    depended on how tokens were grouped into deltas (a worker may send several at once):
    "abcd" whole gave "x", "abc" then "d" gave "xa". vLLM takes the match that completes
    first (ties in list order), as if the text came a character at a time."""
    whole = StopMatcher(("abcd", "bc"))
    assert whole.feed("xabcd") == ("xa", True) and whole.matched == "bc"
    split = StopMatcher(("abcd", "bc"))
    assert split.feed("xabc") == ("xa", True) and split.matched == "bc"
    inner = StopMatcher(("bc", "b"))
    assert inner.feed("abc") == ("a", True) and inner.matched == "b"  # "b" completes first

