"""What a choice sends as it streams (its text rebuilt from the engine's deltas, stop strings
on decoded text, characters never split), and chat templates rendered exactly as
transformers renders them."""

import asyncio
import json
import time

import pytest
import tokenizers
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import examples
from kvpool.engine import TokenLogprobs
from kvpool.errors import CheckpointError
from kvpool.models.tokenizer import ByteTokenizer, HFTokenizer
from kvpool.server.chat import ChatTemplate
from kvpool.server.detokenize import ChoiceText, StopMatcher
from kvpool.server.engine_loop import RequestStream, Sample, Update
from kvpool.server.generation import Change, Generation
from kvpool.server.protocol import ChatMessage, RequestError


def test_a_trailing_replacement_character_waits_for_the_rest_of_its_bytes():
    choice = ChoiceText()
    assert choice.update("ab\ufffd", 3, None) == "ab"
    assert choice.update("ab\u00e9", 4, None) == "\u00e9"
    assert choice.text == "ab\u00e9"


def test_a_replacement_character_is_sent_once_text_follows_it_or_the_choice_ends():
    choice = ChoiceText()
    assert choice.update("a\ufffd", 2, None) == "a"
    assert choice.update("a\ufffdb\ufffd", 4, None) == "\ufffdb"
    assert choice.update("a\ufffdb\ufffd", 4, "length") == "\ufffd"
    assert choice.finish_reason == "length"


def test_a_trailing_run_of_replacement_characters_waits_whole():
    # the first two bytes of a four-byte character decode as two U+FFFD
    choice = ChoiceText()
    assert choice.update("ab\ufffd\ufffd", 3, None) == "ab"
    assert choice.update("ab\U0001F600", 4, "length") == "\U0001F600"
    assert choice.text == "ab\U0001F600"


def test_a_stream_rebuilds_each_samples_text_from_the_engines_deltas():
    # The engine resends a text from its trailing U+FFFD, which a later byte may complete.
    stream = RequestStream("r", n=2)
    stream.receive(False, 0, None, [(0, 0, "ab\ufffd", 3, None, None),
                                    (1, 0, "x", 1, None, None)])
    stream.receive(False, 0, None, [(0, 2, "\u00e9c", 5, None, None),
                                    (1, 1, "y", 2, "length", None)])
    update = asyncio.run(stream.get())
    assert [(s.text, s.num_tokens, s.finish_reason) for s in update.samples] == [
        ("ab\u00e9c", 5, None), ("xy", 2, "length")]


def test_a_reader_that_fell_behind_gets_the_log_probabilities_of_every_update_it_skipped():
    first, second = TokenLogprobs(1, -0.5, ()), TokenLogprobs(2, -1.5, ())
    stream = RequestStream("r", n=1)
    stream.receive(False, 0, None, [(0, 0, "a", 1, None, [first])])
    stream.receive(False, 0, None, [(0, 1, "b", 2, None, [second])])
    update = asyncio.run(stream.get())
    assert update.samples[0].text == "ab"
    assert update.samples[0].new_logprobs == [first, second]


def _served(texts, stop, read_each):
    """The whole response of a request whose sample's text is `texts[i]` after step i (a
    token a step, with its log-probability), the reader taking every update or only the
    last one (a client reading slowly)."""
    generation = Generation("r", "m", num_prompt_tokens=1, n=1, stop=stop, chat=False,
                            include_usage=True, logprobs=0, token_text=str)
    stream, sent = RequestStream("r", n=1), 0
    for step, text in enumerate(texts, 1):
        last = step == len(texts)
        stream.receive(last, 0, None, [(0, sent, text[sent:], step, "length" if last else None,
                                        [TokenLogprobs(step, -1.0, ())])])
        sent = len(text.rstrip("\ufffd"))
        if read_each or last:
            generation.update(asyncio.run(stream.get()))
    response = generation.response()
    del response["created"]  # the clock's second, which two calls may see differ
    return response


@pytest.mark.parametrize("texts", [
    ["a", "aX", "aXY", "aXYb", "aXYbc", "aXYbcd"],  # the stop string ends with step 3
    ["a", "a\ufffd", "aXY", "aXYb\ufffd", "aXYb\u00e9"],  # ... its text once unfinished
    ["a", "a", "aXY", "aXY", "aXYb"],  # ... after a step that decoded to no character
])
def test_a_reader_that_fell_behind_counts_the_tokens_up_to_a_stop_string_as_one_that_did_not(
        texts):
    slow, fast = _served(texts, ("XY",), False), _served(texts, ("XY",), True)
    assert slow == fast
    assert slow["usage"]["completion_tokens"] == 3
    assert slow["choices"][0]["text"] == "a"
    assert slow["choices"][0]["logprobs"]["tokens"] == ["1", "2", "3"]


def test_a_choice_ended_by_a_stop_string_sends_nothing_more_while_the_others_run():
    generation = Generation("r", "m", num_prompt_tokens=1, n=2, stop=("X",), chat=False,
                            include_usage=False, logprobs=None, token_text=str)
    first = generation.update(Update("r", False, 0, None, [Sample(0, "aX", 2, None, None),
                                                           Sample(1, "b", 1, None, None)]))
    assert first == [Change(0, "a", "stop", None), Change(1, "b", None, None)]
    # the engine runs the request until the server aborts it: choice 0 comes again
    later = generation.update(Update("r", False, 0, None, [Sample(0, "aXc", 3, None, None),
                                                           Sample(1, "bc", 2, None, None)]))
    assert later == [Change(1, "c", None, None)]
    assert not generation.done
    assert generation.num_completion_tokens == 2 + 2


def test_a_reader_that_fell_behind_places_a_stop_string_after_a_character_still_incomplete():
    # "a\ufffd": the second token began a character; the third made it "X", the stop string
    texts = ["a", "a\ufffd", "aX"]
    slow, fast = _served(texts, ("X",), False), _served(texts, ("X",), True)
    assert slow == fast
    assert slow["usage"]["completion_tokens"] == 3
    assert slow["choices"][0]["text"] == "a"


def test_a_reader_that_fell_behind_streams_log_probabilities_only_up_to_a_stop_string():
    generation = Generation("r", "m", num_prompt_tokens=1, n=1, stop=("XY",), chat=False,
                            include_usage=False, logprobs=0, token_text=str)
    stream, sent = RequestStream("r", n=1), 0
    for step, text in enumerate(["a", "aX", "aXY", "aXYb", "aXYbc"], 1):  # none read
        stream.receive(False, 0, None, [(0, sent, text[sent:], step, None,
                                         [TokenLogprobs(step, -1.0, ())])])
        sent = len(text)
    (change,) = generation.update(asyncio.run(stream.get()))
    assert (change.text, change.finish_reason) == ("a", "stop")
    assert [entry.token_id for entry in change.logprobs] == [1, 2, 3]


def test_completion_logprobs_name_apart_tokens_that_read_alike():
    texts = {1: "the", 2: "the", 3: "\ufffd", 4: "\ufffd", 5: "a"}  # "▁the" and "the" alone
    generation = Generation("r", "m", num_prompt_tokens=1, n=1, stop=(), chat=False,
                            include_usage=False, logprobs=4, token_text=texts.get)
    entry = TokenLogprobs(1, -0.1, ((1, -0.1), (2, -2.0), (3, -3.0), (5, -5.0)))
    logprobs = generation._completion_logprobs([entry], 0)
    assert logprobs["tokens"] == ["token_id:1"]
    assert logprobs["top_logprobs"] == [
        {"token_id:1": -0.1, "token_id:2": -2.0, "token_id:3": -3.0, "a": -5.0}]


def test_completion_logprobs_name_a_token_without_text_by_its_id():
    texts = {1: "", 2: "a"}  # a special token reads as no text
    generation = Generation("r", "m", num_prompt_tokens=1, n=1, stop=(), chat=False,
                            include_usage=False, logprobs=1, token_text=texts.get)
    logprobs = generation._completion_logprobs([TokenLogprobs(1, -0.1, ((2, -0.05),))], 0)
    assert logprobs["tokens"] == ["token_id:1"]
    assert logprobs["top_logprobs"] == [{"a": -0.05, "token_id:1": -0.1}]


def byte_level_bpe(pieces: tuple[bytes, ...] = ()) -> HFTokenizer:
    """A GPT-2-style byte-level BPE tokenizer (a `tokenizers` one): token b is byte b, then
    one token for each of `pieces` from 256 on."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char = {b: chr(b) for b in shown} | {
        b: chr(0x100 + i) for i, b in enumerate(b for b in range(256) if b not in shown)}
    vocab = {char[b]: b for b in range(256)} | {
        "".join(char[b] for b in piece): 256 + i for i, piece in enumerate(pieces)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return HFTokenizer(tokenizer, None, ())


def text_offsets(tokenizer, token_ids: list[int]) -> list[int]:
    """The completion `text_offset` of a choice of `token_ids`, sent after the prompt "a"."""
    generation = Generation("r", "m", num_prompt_tokens=1, n=1, stop=(), chat=False,
                            include_usage=False, logprobs=0, token_text=str,
                            tokenizer=tokenizer, context=ord("a"))
    entries = [TokenLogprobs(token_id, -1.0, ()) for token_id in token_ids]
    return generation._completion_logprobs(entries, 0)["text_offset"]


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), byte_level_bpe()],
                         ids=["bytes", "byte-level BPE"])
@pytest.mark.parametrize("token_ids, text, offsets", [
    ([0xE3, 0x88, 0x13, 0x41], "\ufffd\x13A", [0, 0, 1, 2]),  # bytes that make no character
    ([0xE3, 0x88, 0xE3, 0x41], "\ufffd\ufffdA", [0, 0, 1, 2]),  # ... cut off by another's
    ([0xFF, 0x41], "\ufffdA", [0, 1]),  # a byte that begins no character
    ([0xE3, 0x88, 0x80, 0x41], "\u3200A", [0, 0, 0, 1]),  # one character's bytes
    ([0xEF, 0xBF, 0xBD, 0x41], "\ufffdA", [0, 0, 0, 1]),  # U+FFFD itself, in UTF-8
    ([0xAD, 0xAA], "\ufffd\ufffd", [0, 1]),  # a run of bytes that begin no character
    ([0xDE, 0xCF, 0x54], "\ufffd\ufffdT", [0, 1, 2]),  # a run of characters cut off
    ([0x82, 0xED, 0xBF], "\ufffd" * 3, [0, 1, 2]),  # ED takes no BF after it
    ([0xAD, 0xE3, 0x81, 0x82], "\ufffd\u3042", [0, 1, 1, 1]),  # a character after a run
])
def test_completion_text_offsets_point_at_the_characters_the_text_holds(tokenizer, token_ids,
                                                                        text, offsets):
    assert tokenizer.decode(token_ids) == text
    assert text_offsets(tokenizer, token_ids) == offsets


@pytest.mark.parametrize("token_ids, text, offsets", [
    ([0xE3, 256], "\u3042", [0, 0]),  # one character's bytes, split unevenly
    ([0xE3, 0x81, 257], "\u3042A", [0, 0, 0]),  # a token ending a character, then one
    ([0xAD, 256], "\ufffd" * 3, [0, 1]),  # a token of two bytes that begin no character
])
def test_completion_text_offsets_place_tokens_of_several_bytes_on_their_first(token_ids, text,
                                                                              offsets):
    tokenizer = byte_level_bpe((b"\x81\x82", b"\x82A"))
    assert tokenizer.decode(token_ids) == text
    assert text_offsets(tokenizer, token_ids) == offsets


def test_text_that_may_begin_a_stop_string_is_held_back():
    choice = ChoiceText(StopMatcher(("STOP",)))
    assert choice.update("hello ST", 8, None) == "hello "
    assert choice.update("hello STX", 9, None) == "STX"


def test_a_held_back_prefix_is_sent_when_the_choice_ends_without_the_stop_string():
    choice = ChoiceText(StopMatcher(("STOP",)))
    assert choice.update("hello ST", 8, None) == "hello "
    assert choice.update("hello ST", 8, "length") == "ST"
    assert (choice.text, choice.finish_reason) == ("hello ST", "length")


def test_a_stop_string_completed_by_a_later_token_ends_the_choice_before_it():
    choice = ChoiceText(StopMatcher(("STOP",)))
    assert choice.update("hello ST", 8, None) == "hello "
    assert choice.update("hello STOP and more", 19, None) == ""
    assert (choice.text, choice.finish_reason, choice.num_tokens) == ("hello ", "stop", 19)
    assert choice.update("hello STOP and more!", 20, None) == ""
    assert choice.num_tokens == 19


def test_the_earliest_of_several_stop_strings_wins():
    choice = ChoiceText(StopMatcher(("b", "xa")))
    assert choice.update("zxab", 4, None) == "z"
    assert choice.finish_reason == "stop"


def test_a_held_back_prefix_is_sent_when_the_stop_string_starts_after_it():
    choice = ChoiceText(StopMatcher(("ab",)))
    assert choice.update("xa", 2, None) == "x"
    assert choice.update("xaab", 4, None) == "a"
    assert choice.text == "xa" and choice.finish_reason == "stop"


def test_the_stop_string_that_ends_first_wins_wherever_the_tokens_split():
    # "bcd" ends before "abcdef" does: a model stopping at once would never write the "ef"
    for steps in (["abcdef"], ["a", "abc", "abcd", "abcdef"]):
        choice = ChoiceText(StopMatcher(("abcdef", "bcd")))
        sent = "".join(choice.update(text, i + 1, None) for i, text in enumerate(steps))
        assert (sent, choice.finish_reason) == ("a", "stop")


def test_a_tail_that_begins_a_stop_string_only_through_a_long_failure_chain_is_held_back():
    # the tail "baaab" of the second text begins "baaaba", a state the automaton finds only
    # by following more than one failure link: its "b" must not be sent
    choice = ChoiceText(StopMatcher(("bbaabbb", "aaaba", "baaaba")))
    sent = [choice.update(text, i + 1, None)
            for i, text in enumerate(["abbbaab", "abbbaabaaab", "abbbaabaaaba"])]
    assert "".join(sent) == choice.text == "abbbaa"
    assert choice.finish_reason == "stop"


def _reference_text(text, stop):
    """What a choice whose sample's text is `text` has sent, found the slow way: cut at the
    stop string that ends first (the longest of those ending there), else short of the
    longest tail that begins a stop string; and whether a stop string ended."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    held = max((k for k in range(1, len(text) + 1) for s in stop
                if s.startswith(text[len(text) - k:])), default=0)
    return text[:len(text) - held], False


@settings(max_examples=examples(300), deadline=None)
@given(stop=st.lists(st.text("ab", min_size=1, max_size=8), min_size=1, max_size=4),
       text=st.text("ab", max_size=24), data=st.data())
def test_stop_strings_end_the_text_as_a_naive_matcher_ends_it(stop, text, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text)))) | {len(text)}) if text else []
    choice = ChoiceText(StopMatcher(tuple(stop)))
    sent = ""
    for step, cut in enumerate(cuts, 1):
        sent += choice.update(text[:cut], step, None)
        expected, stopped = _reference_text(text[:cut], stop)
        assert (sent, choice.text, choice.finished) == (expected, expected, stopped)
        if stopped:
            break
    sent += choice.update(text, len(cuts) + 1, "length")
    expected, stopped = _reference_text(text, stop)
    if not stopped:
        expected = text
    assert (sent, choice.text) == (expected, expected)
    assert choice.finish_reason == ("stop" if stopped else "length")


def test_matching_many_long_stop_strings_takes_time_linear_in_the_text():
    # 100 stop strings of 1,000 characters that a run of "a" keeps beginning: the search
    # that tried every prefix of every stop string took about a minute for these updates.
    stop = tuple(("ab" * 500)[:999] + chr(0x100 + i) for i in range(100))
    text = "a" * 2000
    start = time.perf_counter()
    choice = ChoiceText(StopMatcher(stop))
    sent = "".join(choice.update(text[:k], k, None) for k in range(1, len(text) + 1))
    assert time.perf_counter() - start < 3
    assert sent == text[:-1]  # the last "a" may begin a stop string


LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if loop.index0 == 0 and message['role'] == 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + message['content'] | trim }}"
    "{% continue %}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>\n"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{{ {'n': messages | length, 'last': messages[-1]['content']} | tojson }}")
MESSAGES = [{"role": "system", "content": " Be brief. "},
            {"role": "user", "content": "Héllo, 世界"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again?"}]


@pytest.fixture
def checkpoint(tmp_path):
    config = {"chat_template": LLAMA3_STYLE, "bos_token": "<|begin_of_text|>",
              "eos_token": {"content": "<|eot_id|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_checkpoint_template_renders_as_transformers_renders_it(checkpoint):
    vocab = {"[UNK]": 0, "<|begin_of_text|>": 1, "<|eot_id|>": 2}
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]")),
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_STYLE)
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    template = ChatTemplate.for_model(checkpoint)
    assert template.render([ChatMessage(**m) for m in MESSAGES]) == expected
    assert not template.add_special_tokens


def test_chat_template_jinja_file_comes_before_tokenizer_config(checkpoint):
    (checkpoint / "chat_template.jinja").write_text("{{ eos_token }}{{ messages[0].role }}")
    assert ChatTemplate.for_model(checkpoint).render([ChatMessage("user", "x")]) == \
        "<|eot_id|>user"


def test_a_multimodal_processors_chat_template_json_serves_when_the_tokenizer_has_none(
        tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "chat_template.json").write_text(
        json.dumps({"chat_template": "{{ messages[0].content }}{{ eos_token }}"}))
    assert ChatTemplate.for_model(tmp_path).render([ChatMessage("user", "x")]) == "x<eos>"


def test_a_named_default_template_is_used_from_a_list(tmp_path):
    config = {"chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "plain"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.for_model(tmp_path).render([ChatMessage("user", "x")]) == "plain"


def test_the_fallback_template_is_role_lines_then_the_assistant_turn(tmp_path):
    template = ChatTemplate.for_model("tiny")
    rendered = template.render([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")])
    assert rendered == "system: Be brief.\nuser: hi\nassistant:"
    assert template.add_special_tokens
    assert ChatTemplate.for_model(tmp_path).render([ChatMessage("user", "x")]) == \
        "user: x\nassistant:"


def test_a_template_that_raises_refuses_the_request(checkpoint):
    with pytest.raises(RequestError, match="refused the messages: unknown role tool") as info:
        ChatTemplate.for_model(checkpoint).render([ChatMessage("tool", "x")])
    assert info.value.status == 400 and info.value.param == "messages"


def test_a_template_that_reaches_for_python_internals_is_refused(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{{ ''.__class__.__mro__[1].__subclasses__() | length }}")
    with pytest.raises(RequestError, match="refused the messages") as info:
        ChatTemplate.for_model(tmp_path).render([ChatMessage("user", "x")])
    assert info.value.param == "messages"


def test_special_tokens_come_from_their_own_file_unless_the_config_names_them(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        "eos_token": "<config eos>", "bos_token": None}))  # a null names no token
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert ChatTemplate.for_model(tmp_path).render([ChatMessage("user", "x")]) == \
        "<s>x<config eos>"


def test_a_generation_block_renders_its_body_as_transformers_does(tmp_path):
    source = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
              "[{{ m.content }}]{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
              "{% endfor %}")
    (tmp_path / "chat_template.jinja").write_text(source)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, "[UNK]")),
        chat_template=source)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ChatTemplate.for_model(tmp_path).render([ChatMessage(**m) for m in messages]) == \
        hf.apply_chat_template(messages, tokenize=False) == "hi[hello]"


def test_a_template_that_does_not_compile_names_the_checkpoint(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(CheckpointError, match=f"the chat template of {tmp_path} does not "
                                              f"compile: .*endfor"):
        ChatTemplate.for_model(tmp_path)
