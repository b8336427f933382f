"""What a person reads beside each setting in the launchpad and beside each check in the UI."""

import pytest

from assets.data_assets import RawExamplesConfig, TrainingDatasetConfig
from assets.evaluation_assets import EvaluationConfig, PromotionConfig
from assets.model_assets import BaseModelConfig
from assets.training_assets import TrainingRunConfig


def test_every_asset_check_says_what_it_checks():
    from pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    undescribed = [key.to_user_string() for key in graph.asset_check_keys if not graph.get_check_spec(key).description]
    assert undescribed == []


@pytest.mark.parametrize("config", [BaseModelConfig, RawExamplesConfig, TrainingDatasetConfig, TrainingRunConfig,
                                    EvaluationConfig, PromotionConfig])
def test_every_setting_of_every_asset_is_described(config):
    assert [name for name, field in config.model_fields.items() if not field.description] == []
