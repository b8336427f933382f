"""prompt_format='chat_template': prompts laid out in the tokenizer's chat template, as an instruct model
sees them at inference, by the writer, the quality checks and evaluation alike; templates that cannot be
trained that way are refused before anything is written."""

from __future__ import annotations

import json
import pickle
import typing
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data.dataset_writer import DatasetSpec, read_eval_records, read_prompt_format, write_dataset
from training_core.data.demo_task import generate_records
from training_core.data.packing import IGNORE_INDEX, is_eval_example, pack_examples, tokenize_examples
from training_core.data.prompt_format import CHAT_TEMPLATE, PLAIN, PROMPT_FORMATS
from training_core.data.quality import run_dataset_checks
from training_core.data.window import DatasetWindow
from training_core.errors import ConfigError, SourceDataError

from .tokenizer_support import chat_model_folder, chat_tokenizer

CHAT = DatasetSpec(prompt_format=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="module")
def records():
    return generate_records("2026-11-01", 400)


def test_a_chat_prompt_is_the_templates_user_turn_as_apply_chat_template_tokenizes_it(tokenizer, records):
    example = tokenize_examples(tokenizer, [records[0]["prompt"]], [records[0]["response"]], CHAT_TEMPLATE)[0]
    turn = [{"role": "user", "content": records[0]["prompt"]}]
    assert example.prompt_ids == tokenizer.apply_chat_template(turn, add_generation_prompt=True)["input_ids"]
    assert example.prompt_ids.count(tokenizer.bos_token_id) == 1  # the template's; none added on top
    assert tokenizer.convert_ids_to_tokens(example.prompt_ids[-1]) == "<|assistant|>"
    response = tokenizer(records[0]["response"], add_special_tokens=False)["input_ids"]
    assert example.response_ids == [*response, tokenizer.eos_token_id]
    # what the model is trained on is what the template renders for the whole exchange
    exchange = [*turn, {"role": "assistant", "content": records[0]["response"]}]
    assert example.prompt_ids + example.response_ids == tokenizer.apply_chat_template(exchange)["input_ids"]


def test_a_chat_dataset_trains_only_the_responses_and_records_its_format(tokenizer, records, tmp_path):
    dataset = write_dataset(records, tokenizer, tmp_path / "chat", CHAT, source_label="chat")
    examples = tokenize_examples(tokenizer, [r["prompt"] for r in records], [r["response"] for r in records],
                                 CHAT_TEMPLATE)
    first = next(e for e in examples if not is_eval_example(e.prompt_ids, CHAT.eval_fraction))
    row = pq.read_table(sorted((Path(dataset.path) / "train").glob("*.parquet"))[0]).slice(0, 1).to_pylist()[0]
    length = len(first.prompt_ids) + len(first.response_ids)
    assert row["input_ids"][:length] == first.prompt_ids + first.response_ids
    assert row["labels"][:length] == [IGNORE_INDEX] * len(first.prompt_ids) + first.response_ids
    assert dataset.prompt_format == CHAT_TEMPLATE == read_prompt_format(dataset.path)
    assert json.loads((Path(dataset.path) / "manifest.json").read_text())["spec"]["prompt_format"] == CHAT_TEMPLATE

    # the held-out split is the chat layout's, so evaluation scores prompts laid out as in training
    held_out = {(r["prompt"], r["response"]) for r in read_eval_records(dataset.path)}
    expected = {(r["prompt"], r["response"]) for r, e in zip(records, examples)
                if is_eval_example(e.prompt_ids, CHAT.eval_fraction)}
    assert held_out == expected and held_out


def test_a_plain_datasets_manifest_is_written_as_before_formats_existed(tokenizer, records, tmp_path):
    """Same records, same bytes, same digest: upgrading does not make every day's dataset look changed."""
    dataset = write_dataset(records, tokenizer, tmp_path / "plain", DatasetSpec(), source_label="plain")
    spec = json.loads((Path(dataset.path) / "manifest.json").read_text())["spec"]
    assert set(spec) == {"seq_len", "row_group_rows", "rows_per_file", "eval_fraction", "max_eval_examples"}
    assert dataset.prompt_format == PLAIN == read_prompt_format(dataset.path)


def test_the_quality_checks_tokenize_records_as_the_chat_dataset_was_written(tokenizer, records, tmp_path):
    dataset = write_dataset(records, tokenizer, tmp_path / "chat", CHAT, source_label="chat")
    outcomes = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records)}
    assert all(o.passed for o in outcomes.values()), {n: o.description for n, o in outcomes.items() if not o.passed}

    # A held-out example copied into training, in the chat layout: found only if the check lays it out so.
    held_out = read_eval_records(dataset.path)[0]
    first_file = sorted((Path(dataset.path) / "train").glob("*.parquet"))[0]
    table = pq.read_table(first_file)
    copied = pack_examples(tokenize_examples(tokenizer, [held_out["prompt"]], [held_out["response"]], CHAT_TEMPLATE),
                           dataset.seq_len, tokenizer.pad_token_id)
    extra = pa.table({name: copied[name].tolist() for name in ("input_ids", "labels")}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), first_file)
    leakage = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["no_eval_leakage"]
    assert not leakage.passed and leakage.metadata["leaked_examples"] == 1, leakage.description


def test_a_window_mixing_prompt_formats_is_refused_naming_the_days(tokenizer, records, tmp_path):
    plain = write_dataset(records, tokenizer, tmp_path / "1", DatasetSpec(), source_label="d1")
    chat = write_dataset(records, tokenizer, tmp_path / "2", CHAT, source_label="d2")
    with pytest.raises(ValueError, match=r"partitions 2026-11-01 \(prompt_format=plain\), 2026-11-02 "
                                         r"\(prompt_format=chat_template\) laid out their prompts differently.*"
                                         r"rematerialize training_dataset for them with one prompt_format"):
        DatasetWindow.from_partitions({"2026-11-01": plain, "2026-11-02": chat})
    again = write_dataset(records[:300], tokenizer, tmp_path / "3", CHAT, source_label="d3")
    assert DatasetWindow.from_partitions({"2026-11-02": chat, "2026-11-03": again}).prompt_format == CHAT_TEMPLATE
    # handed over (pickled by Dagster) before PublishedDataset recorded a format: every such dataset is plain
    older = replace(plain)
    del older.__dict__["prompt_format"]
    older = pickle.loads(pickle.dumps(older))
    assert "prompt_format" not in older.__dict__ and older.prompt_format == PLAIN
    with pytest.raises(ValueError, match=r"2026-11-01 \(prompt_format=plain\), 2026-11-02 \(prompt_format=chat_"):
        DatasetWindow.from_partitions({"2026-11-01": older, "2026-11-02": chat})


REFUSED_TEMPLATES = {
    "no template": (None, r"prompt_format='chat_template' but it has no chat template"),
    "turn ends without eos": (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}",
        r"its chat template does not end the assistant turn with the eos token '</s>' right after the response "
        r"\(the turn renders as 'Hello '\).*set eos_token in the model folder's tokenizer_config.json"),
    "template raises": (
        "{{ raise_exception('only system turns') }}",
        r"its chat template cannot render a user turn followed by an assistant turn \(.*only system turns\)"),
}


@pytest.mark.parametrize("template, refusal", REFUSED_TEMPLATES.values(), ids=REFUSED_TEMPLATES.keys())
def test_a_template_that_cannot_lay_out_training_is_refused_before_anything_is_written(tmp_path, records,
                                                                                     template, refusal):
    tokenizer = chat_tokenizer(tmp_path / "tokenizer", template)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigError, match=rf"tokenizer {tmp_path / 'tokenizer'}: {refusal}"):
        write_dataset(records, tokenizer, out, CHAT, source_label="p")
    assert list(out.iterdir()) == []


def test_an_unknown_prompt_format_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"prompt_format must be one of plain, chat_template, got 'chatml'"):
        DatasetSpec(prompt_format="chatml")


def test_the_launchpad_offers_exactly_the_formats_the_writer_knows():
    from assets.data_assets import TrainingDatasetConfig

    assert typing.get_args(TrainingDatasetConfig.model_fields["prompt_format"].annotation) == PROMPT_FORMATS
    assert TrainingDatasetConfig().prompt_format == DatasetSpec().prompt_format == PLAIN


def test_a_user_prompt_holding_bos_is_refused_while_the_templates_own_bos_is_kept(tokenizer, records, tmp_path):
    bad = [*records[:50], {"prompt": "<s> encode: a b", "response": "c d"}]
    with pytest.raises(SourceDataError, match=r"record 50 \(0-based\) .*its prompt holds the special token '<s>'"):
        write_dataset(bad, tokenizer, tmp_path / "bad", CHAT, source_label="p")


def test_evaluation_scores_held_out_records_in_the_datasets_layout(tmp_path, records):
    """Threaded from the job to every model it scores: the same weights as base and trained score the
    same, and the loss is the chat layout's, not the plain one's."""
    from training_core.evaluate.compare import EvaluationJob, run_evaluation
    from training_core.evaluate.metrics import evaluate, load_model_for_eval
    from training_core.evaluate.settings import EvalSettings

    folder = chat_model_folder(tmp_path / "model")
    tokenizer = chat_tokenizer(tmp_path / "tokenizer")
    held_out, settings = records[:16], EvalSettings().for_this_process()
    outcome = run_evaluation(EvaluationJob(str(folder), str(folder), held_out, settings, None, CHAT_TEMPLATE))
    model = load_model_for_eval(str(folder), None, settings)
    chat = evaluate(model, tokenizer, held_out, settings.batch_size, CHAT_TEMPLATE)
    plain = evaluate(model, tokenizer, held_out, settings.batch_size, PLAIN)
    assert outcome.base == outcome.trained == chat
    assert not np.isclose(chat.loss, plain.loss)


def test_the_champion_is_scored_in_this_runs_layout_even_when_its_folder_has_no_template(tmp_path, records):
    """A champion trained on a base model with the same tokenizer but no chat template (the base model of
    an instruct one) is compared on the same token sequences, not refused or scored in another layout."""
    import shutil

    from training_core.evaluate.compare import EvaluationJob, champion_not_comparable, run_evaluation
    from training_core.evaluate.settings import EvalSettings

    folder = chat_model_folder(tmp_path / "instruct")
    without_template = tmp_path / "base"
    shutil.copytree(folder, without_template)
    (without_template / "chat_template.jinja").unlink()
    assert champion_not_comparable(str(without_template), str(folder)) is None
    job = EvaluationJob(str(folder), str(folder), records[:16], EvalSettings(), (str(without_template), str(folder)),
                        CHAT_TEMPLATE)
    outcome = run_evaluation(job)
    assert outcome.champion == outcome.trained


def test_a_template_that_writes_the_clock_into_its_system_turn_renders_the_same_every_time(tmp_path):
    """As Llama 3.2's does (strftime_now unless date_string is given): the layout must not depend on when a
    day is written, evaluated or reproduced. Microseconds here, so two renders always differ if unpinned."""
    from training_core.data.prompt_format import TEMPLATE_VARIABLES, chat_prompt_texts

    from .tokenizer_support import CHAT_TEMPLATE as TEMPLATE

    dated = ("{%- if not date_string is defined %}{%- set date_string = strftime_now('%H:%M:%S.%f') %}{%- endif %}"
             "<|system|> {{ date_string }} " + TEMPLATE)
    tokenizer = chat_tokenizer(tmp_path / "tokenizer", dated)
    first, second = chat_prompt_texts(tokenizer, ["encode: a b"]), chat_prompt_texts(tokenizer, ["encode: a b"])
    assert first == second and TEMPLATE_VARIABLES["date_string"] in first[0]


# The shapes of two families' instruct templates (simplified: no system or tool turns), each with the eos
# its instruct tokenizer ships, and with the eos of its base model's tokenizer, which ends no turn.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
          "m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
INSTRUCT = {
    "Qwen": (CHATML, QWEN_MARKERS, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "Llama 3": (LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}


@pytest.mark.parametrize("template, markers, special_tokens", INSTRUCT.values(), ids=INSTRUCT.keys())
def test_instruct_template_shapes_are_accepted_with_their_turn_end_as_eos(tmp_path, records, template, markers,
                                                                         special_tokens):
    tokenizer = chat_tokenizer(tmp_path / "tokenizer", template, markers, **special_tokens)
    dataset = write_dataset(records, tokenizer, tmp_path / "out", CHAT, source_label="p")
    example = tokenize_examples(tokenizer, [records[0]["prompt"]], [records[0]["response"]], CHAT_TEMPLATE)[0]
    exchange = [{"role": "user", "content": records[0]["prompt"]},
                {"role": "assistant", "content": records[0]["response"]}]
    rendered = tokenizer.apply_chat_template(exchange)["input_ids"]
    assert rendered[: len(example.prompt_ids) + len(example.response_ids)] == example.prompt_ids + example.response_ids
    assert dataset.train_examples > 0


def test_a_base_models_tokenizer_under_its_instruct_template_is_refused_showing_the_turn_end(tmp_path, records):
    """Qwen's base tokenizer ends text with <|endoftext|>, which ChatML never puts after a response."""
    tokenizer = chat_tokenizer(tmp_path / "tokenizer", CHATML, QWEN_MARKERS, bos_token=None,
                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    with pytest.raises(ConfigError, match=r"does not end the assistant turn with the eos token '<\|endoftext\|>' right "
                                          r"after the response \(the turn renders as 'Hello<\|im_end\|>\\n'\)"):
        write_dataset(records, tokenizer, tmp_path / "out", CHAT, source_label="p")
