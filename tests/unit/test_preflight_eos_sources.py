"""Which eos ids the training-data preflight accepts a row's last trained token as, read from every
file of the base-model folder that names one, and which row it names when a file holds null rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.tokenizer_support import local_tokenizer
from training_core.base_model import load_model_config
from training_core.errors import SourceDataError
from training_core.train.data_preflight import base_model_eos_token_ids, check_training_data

TOKENS = pa.list_(pa.int32())


def _packed_rows(folder, eos: int, rows: int = 8, **write_options) -> str:
    """Rows laid out as Tessera packs them: [bos prompt | response eos] twice, then padding."""
    ids = [1, 10, 20, eos, 1, 11, 21, eos, 0, 0]
    labels = [-100, -100, 20, eos, -100, -100, 21, eos, -100, -100]
    folder.mkdir()
    pq.write_table(pa.table({"input_ids": pa.array([ids] * rows, TOKENS), "labels": pa.array([labels] * rows, TOKENS)}),
                   folder / "part-0.parquet", **write_options)
    return str(folder)


def test_data_packed_with_the_tokenizers_eos_passes_when_the_config_names_another(tmp_path):
    """A base model's tokenizer saved with another eos than its config (a chat tokenizer on a base
    model): the dataset writer ends each example with the tokenizer's eos, so rows ending in it are
    packed as Tessera packs them; the config's eos stays accepted too (data written before)."""
    from transformers import LlamaConfig

    model = tmp_path / "model"
    tokenizer = local_tokenizer(model, bos_token="<s>", eos_token="<|end_of_turn|>", pad_token="<pad>")
    LlamaConfig(vocab_size=len(tokenizer), eos_token_id=2).save_pretrained(model)
    assert tokenizer.eos_token_id != 2

    eos_token_ids = base_model_eos_token_ids(str(model), load_model_config(str(model)))
    assert eos_token_ids == {2, tokenizer.eos_token_id}
    assert check_training_data([_packed_rows(tmp_path / "chat", tokenizer.eos_token_id)], 4, 2,
                               eos_token_ids=eos_token_ids) == 8
    assert check_training_data([_packed_rows(tmp_path / "base", 2)], 4, 2, eos_token_ids=eos_token_ids) == 8
    with pytest.raises(SourceDataError, match=r"row 0: its last trained token is 21, not the base model's eos"):
        check_training_data([_packed_rows(tmp_path / "other", 21)], 4, 2, eos_token_ids=eos_token_ids)


def test_the_eos_of_a_nested_text_config_is_accepted(tmp_path):
    """Gemma 3's config.json nests its language model's config under text_config, with its own eos
    (end of turn) beside the outer one."""
    from transformers import Gemma3Config

    Gemma3Config(eos_token_id=1, text_config={"eos_token_id": 106, "vocab_size": 256}).save_pretrained(tmp_path / "gemma")
    eos_token_ids = base_model_eos_token_ids(str(tmp_path / "gemma"), load_model_config(str(tmp_path / "gemma")))
    assert eos_token_ids == {1, 106}
    assert check_training_data([_packed_rows(tmp_path / "d", 106)], 4, 2, eos_token_ids=eos_token_ids) == 8


def test_a_composite_config_without_a_top_level_eos_reads_its_text_configs(tmp_path):
    # transformers 5 gives such a config no eos_token_id attribute at all (AttributeError, not None).
    from transformers import Gemma3Config

    Gemma3Config(text_config={"eos_token_id": 106, "vocab_size": 256}).save_pretrained(tmp_path / "gemma")
    config = load_model_config(str(tmp_path / "gemma"))
    assert not hasattr(config, "eos_token_id")
    assert 106 in base_model_eos_token_ids(str(tmp_path / "gemma"), config)  # (with generation_config.json's)


def test_a_row_after_null_rows_is_named_by_its_row_in_the_file(tmp_path):
    """A file written without statistics hides its null rows from the footer: the preflight skips
    them in the first row group (the worker names them) and still names a bad row by its place."""
    eos = 2
    packed = ([1, 10, 20, eos, 1, 11, 21, eos], [-100, -100, 20, eos, -100, -100, 21, eos])
    unpacked = ([1, 10, 11, 20, 21, 20, 22, 21], [-100, -100, -100, 20, 21, 20, 22, 21])
    rows = [packed, None, None, unpacked] + [packed] * 4
    folder = tmp_path / "d"
    folder.mkdir()
    table = pa.table({"input_ids": pa.array([row and row[0] for row in rows], TOKENS),
                      "labels": pa.array([row and row[1] for row in rows], TOKENS)})
    pq.write_table(table, folder / "part-0.parquet", write_statistics=False)

    with pytest.raises(SourceDataError, match=r"part-0\.parquet: row 3: its last trained token is 21, not the base "
                                              r"model's eos \(2\)"):
        check_training_data([str(folder)], 4, 2, eos_token_ids={eos})
    without_bad_row = pa.concat_tables([table.slice(0, 3), table.slice(4)])
    pq.write_table(without_bad_row, folder / "part-0.parquet", write_statistics=False)
    assert check_training_data([str(folder)], 1, 1, eos_token_ids={eos}) == 7  # null rows: left to the worker
