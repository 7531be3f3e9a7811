import json

import pytest

from pipeline.build.inputs.tokenizer_patterns import check_tokenizer_patterns, nested_unbounded
from pipeline.errors import InputError

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
QWEN2 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
O200K = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
    r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
DEEPSEEK = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
)


@pytest.mark.parametrize(
    "pattern",
    [GPT2, LLAMA3, QWEN2, O200K, DEEPSEEK, r"\p{N}{1,3}", "(ab){2,5}", "(a+){3}", "a{,3}", "x{", "x{a,}", "[(a+)+]",
     r"\(a+\)+", "(?<word>a+)b", "[[:alpha:]]+", r"[\]a+]+", " ?\\x{41}+", "(?>a)+"],
)  # fmt: skip
def test_nested_unbounded_finds_nothing_in_real_and_bounded_patterns(pattern):
    assert nested_unbounded(pattern) is None


@pytest.mark.parametrize(
    "pattern, nested",
    [
        ("(a+)+b", "(a+)+"),
        ("(a*)*", "(a*)*"),
        ("x(?:y*z)*", "(?:y*z)*"),
        ("((a+))+", "((a+))+"),
        ("(a+){2,}", "(a+){2,}"),
        ("(a|b+)*?c", "(a|b+)*?"),
        (r"(\s+\w)+", r"(\s+\w)+"),  # refused though \s and \w cannot overlap: the check is conservative
        (r"(\p{L}+\d?)+x", r"(\p{L}+\d?)+"),
        ("([a-z]+)++", "([a-z]+)++"),
    ],
)
def test_nested_unbounded_names_the_group_that_repeats_an_unbounded_repeat(pattern, nested):
    assert nested_unbounded(pattern) == nested


def test_nested_unbounded_reads_deeply_nested_patterns_without_recursion():
    assert nested_unbounded("(" * 100_000 + "a" + ")" * 100_000) is None
    assert nested_unbounded("(" * 100_000 + "a+" + ")+" * 100_000) == "(a+)+"  # the innermost


def _tokenizer_json(pre_tokenizer=None, normalizer=None) -> str:
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer.to_str()


def test_check_tokenizer_patterns_passes_real_split_patterns():
    from tokenizers import Regex, pre_tokenizers

    for pattern in (GPT2, LLAMA3, QWEN2, O200K):
        split = pre_tokenizers.Split(Regex(pattern), "isolated")
        check_tokenizer_patterns(_tokenizer_json(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel()])), "t")
    check_tokenizer_patterns(_tokenizer_json(pre_tokenizers.BertPreTokenizer()), "tokenizer.json")


def test_check_tokenizer_patterns_refuses_a_backtracking_split_in_one_line_naming_it():
    from tokenizers import Regex, pre_tokenizers

    bad = pre_tokenizers.Split(Regex("(a+)+b"), "isolated")
    text = _tokenizer_json(pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), bad]))
    with pytest.raises(InputError) as raised:
        check_tokenizer_patterns(text, "ckpt/tokenizer.json")
    message = str(raised.value)
    assert message.startswith("ckpt/tokenizer.json: the pre_tokenizer's Split pattern '(a+)+b' repeats '(a+)+'")
    assert "\n" not in message
    with pytest.raises(InputError, match="pre_tokenizer's Split"):
        check_tokenizer_patterns(json.loads(text), "ckpt/tokenizer.json")


def test_check_tokenizer_patterns_refuses_a_backtracking_replace_in_the_normalizer():
    from tokenizers import Regex, normalizers

    replace = normalizers.Replace(Regex("(x*)*y"), "z")
    text = _tokenizer_json(normalizer=normalizers.Sequence([normalizers.NFC(), replace]))
    with pytest.raises(InputError, match=r"the normalizer's Replace pattern '\(x\*\)\*y' repeats '\(x\*\)\*'"):
        check_tokenizer_patterns(text, "tokenizer.json")


def test_check_tokenizer_patterns_ignores_plain_string_patterns():
    from tokenizers import normalizers

    check_tokenizer_patterns(_tokenizer_json(normalizer=normalizers.Replace("(a+)+", "x")), "tokenizer.json")
