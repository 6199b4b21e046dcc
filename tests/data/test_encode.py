"""Encoding examples into Prompts: the chat template applied once (no second BOS), and no encoding that loses
text. The tiny tokenizers are real: built from the arithmetic corpus, they know digits, '+' and '=' only."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import Prompt
from asyncrl.data import Example, encode_prompt, encode_prompts, prompt_text
from asyncrl.testing.tasks import arithmetic
from asyncrl.testing.tiny import build_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>{% endif %}")


@pytest.fixture
def model_tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer, as the engine and the examples load it (a fresh one: tests set its template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def bare_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny tokenizer alone in a folder, as ``build_tokenizer`` saved it (no model config beside it)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(arithmetic.corpus(), out)
    return AutoTokenizer.from_pretrained(str(out))


def test_plain_prompts_encode_to_prompts_with_ids_text_and_answer(model_tokenizer) -> None:
    prompts = encode_prompts([Example("3+4=", "7"), Example("12+30=", "42")], model_tokenizer, id_prefix="train-")
    assert prompts[0] == Prompt("train-0", tuple(model_tokenizer("3+4=").input_ids), "3+4=", "7")
    assert [p.prompt_id for p in prompts] == ["train-0", "train-1"]
    assert model_tokenizer.decode(prompts[1].token_ids) == "12+30="


def test_text_the_tokenizer_drops_is_refused_naming_the_example_and_what_it_decodes_as(model_tokenizer) -> None:
    # What happens without the check: the model directory's tokenizer drops the letters and spaces it lacks.
    ids = model_tokenizer("Tom has 12 apples and buys 7 more.").input_ids
    assert model_tokenizer.decode(ids) == "127" and model_tokenizer.unk_token_id not in ids
    bad = [Example("1+1=", "2"), Example("Tom has 12 apples and buys 7 more.", "19")]
    with pytest.raises(ValueError) as err:
        encode_prompts(bad, model_tokenizer)
    message = str(err.value)
    assert message.startswith("example 1:") and "'Tom has 12 apples and buys 7 more.'" in message
    assert "decodes as '127'" in message
    with pytest.raises(ValueError, match="decodes as '1234'"):  # a lost space is a lost problem too
        encode_prompt("12 34", model_tokenizer)


def test_the_tiny_tokenizer_maps_unknown_characters_to_unk_and_that_is_refused(bare_tokenizer) -> None:
    unk = bare_tokenizer.unk_token_id
    ids = bare_tokenizer("Tom 12", add_special_tokens=False).input_ids
    assert ids.count(unk) == 4 and bare_tokenizer.decode(ids[-1:]) == "12"  # T, o, m and the space: not dropped
    with pytest.raises(ValueError, match=r"example 0: .*'Tom 12' to its unknown token '<unk>'"):
        encode_prompts([Example("Tom 12", "1")], bare_tokenizer)
    assert encode_prompt("3+4=", bare_tokenizer)  # what it knows still encodes


def test_chat_messages_go_through_the_template_once_with_no_added_bos(model_tokenizer) -> None:
    model_tokenizer.chat_template = TEMPLATE
    messages = [{"role": "user", "content": "3+4="}]
    prompt = encode_prompts([Example(messages, "7")], model_tokenizer)[0]
    assert prompt.text == "<s>3+4=</s><s>"
    assert prompt.token_ids == tuple(model_tokenizer(prompt.text, add_special_tokens=False).input_ids)
    assert prompt.token_ids.count(model_tokenizer.bos_token_id) == 2  # the template's two, none added
    # auto leaves plain text alone; True wraps it as one user message; False joins messages' contents.
    assert prompt_text("3+4=", model_tokenizer) == "3+4="
    assert prompt_text("3+4=", model_tokenizer, chat_template=True) == "<s>3+4=</s><s>"
    assert prompt_text(messages + messages, model_tokenizer, chat_template=False) == "3+4=\n3+4="


def test_without_a_template_messages_are_joined_and_true_is_refused(model_tokenizer) -> None:
    assert not model_tokenizer.chat_template
    messages = [{"role": "system", "content": "1+1="}, {"role": "user", "content": "3+4="}]
    assert prompt_text(messages, model_tokenizer) == "1+1=\n3+4="
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts([Example("3+4=", "7")], model_tokenizer, chat_template=True)
    with pytest.raises(ValueError, match="'auto', True or False"):
        prompt_text("3+4=", model_tokenizer, chat_template="on")


class BosTokenizer:
    """A tokenizer that adds a BOS of its own to plain text, as Llama's does (one id a character)."""

    bos_token_id, unk_token_id, unk_token, all_special_tokens = 1, None, None, ["<s>"]
    chat_template = "yes"

    def __call__(self, text: str, add_special_tokens: bool = True):
        body = text.removeprefix("<s>")
        ids = [1] * (text != body) + [ord(c) for c in body]
        return type("Encoding", (), {"input_ids": [1] * add_special_tokens + ids})

    def decode(self, ids, skip_special_tokens: bool = False, **_: object) -> str:
        return "".join("" if i == 1 and skip_special_tokens else "<s>" if i == 1 else chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        return "<s>" + "".join(f"[{m['content']}]" for m in messages) + "A:"


def test_one_bos_either_way_and_the_tokenizers_own_bos_is_not_a_loss() -> None:
    plain, chat = encode_prompts([Example("hi", "x"), Example([{"role": "user", "content": "hi"}], "x")],
                                 BosTokenizer())
    assert plain.token_ids == (1, ord("h"), ord("i"))  # the tokenizer's BOS on plain text
    assert chat.token_ids.count(1) == 1 and chat.text == "<s>[hi]A:"  # the template's BOS, no second one
