"""How a record's prompt becomes the tokens the model is trained and scored on.

``plain``: ``<bos> prompt`` as the tokenizer splits the text (base models; prompts already laid out).
``chat_template``: the prompt as a user turn in the tokenizer's own chat template, ending with the
assistant turn's opening (``add_generation_prompt``), exactly what ``apply_chat_template`` hands the
model at inference; the template places bos itself. Either way the response follows, then eos, so
packing's layout (every example ends with a trained eos) and generation's stop are unchanged. That
is why a chat template must end the assistant's turn with the tokenizer's eos: instruct tokenizers
ship eos as their turn end (Qwen's ``<|im_end|>``, Llama 3's ``<|eot_id|>``).
"""

from __future__ import annotations

from training_core.errors import ConfigError

PLAIN = "plain"
CHAT_TEMPLATE = "chat_template"
PROMPT_FORMATS = (PLAIN, CHAT_TEMPLATE)

# A conversation rendered once to check a template ends the assistant turn with eos (see require_prompt_format).
_PROBE_PROMPT, _PROBE_RESPONSE = "Hi", "Hello"
# Variables every template render gets. Llama 3.x templates write a date into their system turn, taken from
# the clock (strftime_now) unless date_string is given: pinned (to Llama 3.1's own default), the layout is a
# function of the record alone, so a day's dataset, its eval split and a later reproduction tokenize alike.
TEMPLATE_VARIABLES = {"date_string": "26 Jul 2024"}


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def check_prompt_format_name(prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")


def _token_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _user_turns(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": prompt}] for prompt in prompts]


def require_prompt_format(tokenizer, prompt_format: str) -> None:
    """Refuse, before anything is tokenized, a format this tokenizer cannot lay out: ``chat_template``
    needs a template, and one whose assistant turn ends with eos right after the response (Tessera
    trains ``response eos``; a model trained so under a template that ends turns otherwise would learn
    a turn end its template never renders, and generation stops only at eos)."""
    check_prompt_format_name(prompt_format)
    if prompt_format == PLAIN:
        return
    name = _tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tokenizer {name}: prompt_format='chat_template' but it has no chat template "
                          "(chat_template in tokenizer_config.json or chat_template.jinja); use prompt_format='plain' "
                          "or a tokenizer that ships one")
    user = _user_turns([_PROBE_PROMPT])[0]
    try:
        opening = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **TEMPLATE_VARIABLES)
        whole = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": _PROBE_RESPONSE}],
                                              tokenize=False, **TEMPLATE_VARIABLES)
    except Exception as error:  # noqa: BLE001 - a template's own error (jinja, raise_exception): named, chained
        raise ConfigError(f"tokenizer {name}: its chat template cannot render a user turn followed by an "
                          f"assistant turn ({type(error).__name__}: {error})") from error
    # Compared as tokens, as they are trained: text that differs only where the tokenizer reads it alike
    # (a space before eos, for a tokenizer that splits on whitespace) is the same sequence to the model.
    trained = _token_ids(tokenizer, opening) + _token_ids(tokenizer, _PROBE_RESPONSE) + [tokenizer.eos_token_id]
    if _token_ids(tokenizer, whole)[: len(trained)] != trained:
        rest = (repr(whole[len(opening):]) if whole.startswith(opening)
                else f"{whole!r}, not after its prompt {opening!r}")
        raise ConfigError(
            f"tokenizer {name}: its chat template does not end the assistant turn with the eos token "
            f"{tokenizer.eos_token!r} right after the response (the turn renders as {rest}); Tessera trains each "
            "response followed by eos and generation stops there, so set eos_token in the model folder's "
            "tokenizer_config.json to the template's turn end, or use prompt_format='plain'"
        )


def chat_prompt_texts(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt rendered as the template's user turn with the assistant turn opened."""
    return tokenizer.apply_chat_template(_user_turns(prompts), tokenize=False, add_generation_prompt=True,
                                         **TEMPLATE_VARIABLES)


def prompt_token_ids(tokenizer, prompts: list[str], prompt_format: str) -> list[list[int]]:
    """The prompt tokens of each record, in one batched tokenizer call (a fast tokenizer encodes a
    batch in Rust). ``chat_template`` renders the text and tokenizes it without special tokens, as
    ``apply_chat_template(tokenize=True)`` does, so the template's bos is the only one."""
    if prompt_format == CHAT_TEMPLATE:
        texts = chat_prompt_texts(tokenizer, prompts)
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    check_prompt_format_name(prompt_format)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [[*bos, *ids] for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
