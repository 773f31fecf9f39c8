"""A GGUF file's vocabulary as a `tokenizers` Tokenizer, the way llama.cpp tokenizes it:
byte-level BPE (`tokenizer.ggml.model` "gpt2": GPT-2, Llama 3, SmolLM, gpt-oss) split by the file's
pre-tokenizer, or SentencePiece BPE ("llama": Llama 2, Mistral) with merges recovered from
the token scores. Control tokens become special tokens, user-defined ones added tokens."""

from __future__ import annotations

import warnings

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from kvpool.errors import CheckpointError

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)
SPM_SPACE = "\u2581"  # SentencePiece's word-boundary mark
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's default (a missing tokenizer.ggml.pre too), one split after another: runs of
# punctuation and some ASCII symbols, GPT-2's pattern, digit runs, then ASCII digits in threes
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one at a time
# tiktoken's o200k (gpt-oss, GPT-4o): a word's capitals and lower-case letters apart, its
# contraction kept on it, "/" kept after punctuation
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's (DeepSeek V2's vocabulary too), one split after another: line breaks, a
# word of cased letters with the space before it, a run of ASCII or full-width punctuation
# with the space before it, trailing spaces, a run of CJK ideographs or Hangul, a run of
# digits
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?["
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-"
    "\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-"
    "\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
    "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-"
    "\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
# DeepSeek V3's, one split after another: digits in threes, runs of CJK ideographs and kana,
# then words (an ASCII word keeps the punctuation mark before it), punctuation and spaces
_DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                     r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
                     r"|\s+(?!\S)|\s+")


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    _byte_level()])


def _split_then_byte_level(*regexes: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _default_split() -> pre_tokenizers.PreTokenizer:
    return _split_then_byte_level(*_DEFAULT_SPLITS)


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return _split_then_byte_level(_LLAMA3_SPLIT)


def _qwen2_split() -> pre_tokenizers.PreTokenizer:
    return _split_then_byte_level(_QWEN2_SPLIT)


def _o200k_split() -> pre_tokenizers.PreTokenizer:
    return _split_then_byte_level(_O200K_SPLIT)


def _deepseek_llm_split() -> pre_tokenizers.PreTokenizer:
    return _split_then_byte_level(*_DEEPSEEK_LLM_SPLITS)


def _deepseek3_split() -> pre_tokenizers.PreTokenizer:
    return _split_then_byte_level(*_DEEPSEEK3_SPLITS)


# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp regexes).
PRE_TOKENIZERS = {
    "default": _default_split, "gpt-2": _byte_level, "gpt2": _byte_level,
    "smollm": _digits_then_byte_level, "starcoder": _digits_then_byte_level,
    "llama-bpe": _llama3_split, "llama3": _llama3_split, "llama-v3": _llama3_split,
    "qwen2": _qwen2_split, "gpt-4o": _o200k_split,
    "exaone4": _byte_level,  # as llama.cpp splits it: GPT-2's pattern
    "glm4": _llama3_split, "chatglm-bpe": _llama3_split,  # Llama 3's pattern, every merge
    "deepseek-llm": _deepseek_llm_split, "deepseek-v3": _deepseek3_split,
}
# Llama 3's vocabulary matches whole pre-tokenized words before applying merges, and adds BOS
# where the file does not say otherwise (llama.cpp's Llama 3 group).
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
# In a file whose general.name names Phi-3, llama.cpp has every control and user-defined token
# but these swallow the whitespace after it, as Phi-3's own tokenizer marks them (rstrip).
_PHI3_KEEP_SPACE = ("<unk>", "<s>", "<|endoftext|>")
# Qwen's tokenizer composes text to Unicode NFC first, as transformers' does (llama.cpp not).
_NFC = ("qwen2",)


def build_tokenizer(meta: dict) -> Tokenizer:
    """The tokenizer of a GGUF file's `tokenizer.*` metadata (key -> value). A tokenizer model
    or pre-tokenizer llama.cpp names but this module does not know, and metadata that does not
    describe a vocabulary, raise CheckpointError."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported (supported: "
                              f"'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    _check_vocabulary(meta, kind)
    try:
        tokenizer = _byte_level_bpe(meta) if kind == "gpt2" else _sentencepiece_bpe(meta)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exception
        raise CheckpointError(f"GGUF vocabulary the tokenizers library refuses: "
                              f"{type(e).__name__}: {e}") from None
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    typed = list(zip(tokens, types, strict=True))
    name = str(meta.get("general.name", "")).lower()
    phi3 = "phi-3" in name or "phi3" in name
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False,
                                             rstrip=phi3 and t not in _PHI3_KEEP_SPACE)
                                  for t, kind in typed if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False,
                                     rstrip=phi3 and t not in _PHI3_KEEP_SPACE)
                          for t, kind in typed if kind == USER_DEFINED])
    bos, eos = (meta.get(f"tokenizer.ggml.{end}_token_id") for end in ("bos", "eos"))
    # llama.cpp adds BOS to SentencePiece and Llama 3 vocabularies unless the file says not
    # to, and EOS where the file says so.
    add_bos = kind == "llama" or meta.get("tokenizer.ggml.pre") in _LLAMA3
    first = [bos] if meta.get("tokenizer.ggml.add_bos_token", add_bos) and bos is not None \
        else []
    last = [eos] if meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None else []
    if first or last:
        def around(text: str) -> str:
            return " ".join([*(tokens[i] for i in first), text, *(tokens[i] for i in last)])

        tokenizer.post_processor = processors.TemplateProcessing(
            single=around("$A"), pair=f"{around('$A')} {around('$B')}",
            special_tokens=sorted({(tokens[i], i) for i in first + last}))
    return tokenizer


def _check_vocabulary(meta: dict, kind: str) -> None:
    """CheckpointError naming the key unless the `tokenizer.*` metadata describes one
    vocabulary: a list of token texts, types and scores (SentencePiece) one per token, token
    ids within it, and merges of two texts each."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise CheckpointError("GGUF tokenizer.ggml.tokens must be a non-empty list of texts")
    lists = ["token_type"] + (["scores"] if kind == "llama" else [])
    for name in lists:
        values = meta.get(f"tokenizer.ggml.{name}")
        if (values is not None or name == "scores") and (
                not isinstance(values, list) or len(values) != len(tokens)):
            found = len(values) if isinstance(values, list) else repr(values)
            raise CheckpointError(f"GGUF tokenizer.ggml.{name} must list one value for each "
                                  f"of the {len(tokens)} tokens, got {found}")
    for name in ("bos", "eos", "eot", "eom", "unknown", "padding", "fim_pad", "fim_rep",
                 "fim_sep"):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens)):
            raise CheckpointError(f"GGUF tokenizer.ggml.{name}_token_id must be a token id in "
                                  f"[0, {len(tokens)}), got {i!r}")
    merges = meta.get("tokenizer.ggml.merges", [])
    bad = next((m for m in merges if not (isinstance(m, str) and " " in m)), None)
    if not isinstance(merges, list) or bad is not None:
        raise CheckpointError(f"GGUF tokenizer.ggml.merges must be texts of two tokens "
                              f"separated by a space, got {bad!r}")


def _byte_level_bpe(meta: dict) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        warnings.warn("kvpool: GGUF byte-level vocabulary without tokenizer.ggml.pre: split as "
                      "llama.cpp splits it, by its 'default' pre-tokenizer, which is probably "
                      "not the model's own (generation quality may suffer; a newer conversion "
                      "of the model names its pre-tokenizer)", stacklevel=2)
        pre = "default"
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))})")
    if "tokenizer.ggml.merges" not in meta:
        raise CheckpointError("GGUF byte-level BPE vocabulary without tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3))
    if pre in _NFC:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict) -> Tokenizer:
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    pairs = _spm_pairs(tokens, scores)
    types = meta.get("tokenizer.ggml.token_type") or []
    tied = _overlapping_ties(pairs, {token for token, kind in zip(tokens, types, strict=False)
                                     if kind in (CONTROL, USER_DEFINED)})
    if tied:
        warnings.warn(f"kvpool: GGUF SentencePiece vocabulary with {tied:,} tokens whose score "
                      f"ties with another's where their merges can overlap: llama.cpp merges "
                      f"the leftmost of two tied merges first, kvpool in one fixed order, so "
                      f"some texts tokenize differently", stacklevel=2)
    tokenizer = Tokenizer(models.BPE(vocab, spm_merges(pairs), byte_fallback=True,
                                     fuse_unk=True, unk_token=None if unk is None else tokens[unk]))
    steps = [normalizers.Replace(" ", SPM_SPACE)]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True)
          else [])])
    return tokenizer


def _spm_pairs(tokens: list[str], scores: list[float]) -> list[tuple[float, str, str, str]]:
    """(score, left, right, token) for every split of a token into two tokens."""
    ids = {token: i for i, token in enumerate(tokens)}
    pairs = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ids and token[i:] in ids]
        pairs.extend((score, left, right, token) for left, right in
                     sorted(splits, key=lambda pair: (ids[pair[0]], ids[pair[1]])))
    return pairs


def spm_merges(pairs: list[tuple[float, str, str, str]]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (`_spm_pairs`): the merges of
    higher-scored results first (SentencePiece merges by score), ties by the longer left
    part, then the longer right part, then vocabulary order."""
    ordered = sorted(pairs, key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right, _ in ordered]


def _overlapping_ties(pairs: list[tuple[float, str, str, str]], added: set[str]) -> int:
    """How many tokens tie in score with another whose merge can overlap theirs (one's right
    part the other's left part), `added` tokens left out (they are matched before any merge):
    llama.cpp merges whichever comes first in the text, which no fixed order of merges can."""
    groups: dict[float, list[tuple[str, str, str]]] = {}
    for score, left, right, token in pairs:
        if token not in added:
            groups.setdefault(score, []).append((left, right, token))
    tied = set()
    for group in groups.values():
        if all(token == group[0][2] for _, _, token in group):
            continue  # the splits of one token: same score, no tie with another
        starts, ends = {}, {}  # a part -> the tokens whose merge it starts / ends
        for left, right, token in group:
            starts.setdefault(left, set()).add(token)
            ends.setdefault(right, set()).add(token)
        tied.update(token for left, right, token in group
                    if starts.get(right, set()) - {token} or ends.get(left, set()) - {token})
    return len(tied)
