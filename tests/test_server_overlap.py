"""The server over an engine with overlap scheduling: greedy completions and stop strings give
the text of the engine without it."""

from functools import partial

from engine_probes import check_cache, overlapping, used_pages
from kvpool.engine import LLM, SamplingParams
from server_util import running_server

PROMPT = "The pool"
ENGINE = partial(LLM, "tiny", num_pages=24, max_model_len=512, max_num_seqs=8, device="cpu")
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_completions_and_stop_strings_with_overlap_give_the_plain_text():
    (expected,) = ENGINE(overlap=False).generate(
        PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    text = expected.outputs[0].text
    stop = text[8:10]
    with running_server(partial(ENGINE, overlap=True)) as server:
        assert server.on_engine(overlapping)
        client = server.client()
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, **GREEDY)
        assert out.choices[0].text == text
        cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                        stop=[stop], **GREEDY)
        assert cut.choices[0].text == text[:text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                                  stop=stop, stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]
        server.wait_idle()
        assert server.on_engine(used_pages) == 0
        server.on_engine(check_cache)
