"""Evaluate base vs trained (vs champion) models on a dataset's held-out split.

torch and transformers (`training_core.evaluate.metrics`) are imported when an evaluation runs:
the Dagster code location imports this module for `EvaluationReport`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from training_core.base_model import load_tokenizer
from training_core.data.prompt_format import PLAIN
from training_core.errors import TesseraError
from training_core.evaluate.model_folder import check_trained_model_dir
from training_core.evaluate.results import EvalMetrics
from training_core.evaluate.settings import EvalSettings

# What a report stored before it recorded its champion reads as (it cannot be promoted safely).
CHAMPION_UNRECORDED = "(not recorded)"


class BaseLossZeroError(TesseraError, ValueError):
    """The base model scores the held-out records with loss 0: no ratio to it, no model to beat it."""


@dataclass(frozen=True)
class EvaluationReport:
    base: EvalMetrics
    trained: EvalMetrics
    trained_model_dir: str
    mlflow_run_id: str
    champion: EvalMetrics | None = None
    # Promotion gates this evaluation failed, by name: () when all passed, None when none were judged
    # (`tessera reproduce`, or a report stored before gates were recorded). Promotion reads it, so a
    # promotion launched on its own still honours the gates of the evaluation it promotes.
    failed_gates: tuple[str, ...] | None = None
    # The MLflow run of the champion when this evaluation judged its gates (None: there was none).
    # Promotion moves the alias only while it still points there: a champion that moved since (a
    # later day promoted by a parallel backfill run) was never compared with this model.
    champion_run_id: str | None = CHAMPION_UNRECORDED

    @property
    def loss_ratio(self) -> float:
        if self.base.loss == 0:
            raise BaseLossZeroError(
                f"MLflow run {self.mlflow_run_id}: the base model scores a held-out loss of 0 on "
                f"{self.base.examples} examples (it predicts every response token with certainty), so the loss "
                "ratio trained / base is undefined and no trained model can beat it; check the held-out records "
                "of the training_dataset partitions evaluated")
        return self.trained.loss / self.base.loss

    def as_metrics(self) -> dict[str, float]:
        champion = self.champion.as_dict("eval_champion_") if self.champion else {}
        return {**self.base.as_dict("eval_base_"), **self.trained.as_dict("eval_"), **champion,
                "eval_loss_ratio": self.loss_ratio}


def evaluate_trained(base_model_path: str, trained_model_dir: str, records: list[dict[str, str]], tokenizer=None,
                     settings: EvalSettings | None = None, prompt_format: str = PLAIN) -> EvalMetrics:
    from training_core.evaluate.metrics import evaluate, load_model_for_eval

    settings = (settings or EvalSettings()).for_this_process()
    tokenizer = tokenizer or load_tokenizer(base_model_path)
    model = load_model_for_eval(base_model_path, trained_model_dir, settings)
    return evaluate(model, tokenizer, records, settings.batch_size, prompt_format)


def evaluate_against_base(base_model_path: str, trained_model_dir: str, records: list[dict[str, str]],
                          settings: EvalSettings | None = None, prompt_format: str = PLAIN,
                          tokenizer=None) -> tuple[EvalMetrics, EvalMetrics]:
    from training_core.evaluate.metrics import evaluate, load_model_for_eval

    # Checked first: a device this process lacks, or a damaged trained folder, would otherwise fail only
    # after the base model's evaluation.
    settings = (settings or EvalSettings()).for_this_process()
    check_trained_model_dir(trained_model_dir)
    tokenizer = tokenizer or load_tokenizer(base_model_path)
    base = evaluate(load_model_for_eval(base_model_path, None, settings), tokenizer, records, settings.batch_size,
                    prompt_format)
    return base, evaluate_trained(base_model_path, trained_model_dir, records, tokenizer, settings, prompt_format)


@dataclass(frozen=True)
class EvaluationJob:
    """One evaluation, as plain data: it runs in this process or ships as is to a Ray task. Every
    path must be readable where it runs (on a cluster: the shared state folder)."""

    base_model_path: str
    trained_model_dir: str
    records: list[dict[str, str]]
    settings: EvalSettings = EvalSettings()
    champion: tuple[str, str] | None = None  # (base model, model folder) of the current champion
    prompt_format: str = PLAIN  # the records' datasets' (DatasetWindow.prompt_format)


@dataclass(frozen=True)
class EvaluationOutcome:
    settings: EvalSettings  # resolved: the device and precision the metrics were produced with
    base: EvalMetrics
    trained: EvalMetrics
    champion: EvalMetrics | None
    where: str  # "<host> pid <pid>": the process that evaluated (a Ray task's, with on_ray_cluster)


def champion_not_comparable(champion_base_model: str, base_model: str) -> str | None:
    """Why the champion's held-out loss cannot be compared with this model's, or None when it can:
    losses are per token, so both must score the same token sequences (same tokenizer and the same
    bos/eos around each example; the base model itself may differ), and scoring the champion needs its
    base model. Both sides are read from the base model folders now, never from a stored digest; that the
    champion's folder still holds the weights it trained on is checked where it is looked up
    (``ModelRegistry.base_model_of``), so the same path here means the same base model."""
    from training_core.base_model import tokenizer_identity

    if champion_base_model == base_model:
        return None
    try:
        theirs = tokenizer_identity(champion_base_model)
    except (OSError, ValueError) as error:  # folder gone, hub id not cached
        return f"the champion's base model {champion_base_model} cannot be loaded ({type(error).__name__}: {error})"
    ours = tokenizer_identity(base_model)
    if theirs.text_digest != ours.text_digest:
        return (f"the champion was trained on {champion_base_model}, whose tokenizer differs from {base_model}'s: "
                "per-token losses do not compare")
    if differences := theirs.special_token_differences(ours):
        named = "; ".join(f"{role} {champions} there, {this} here" for role, champions, this in differences)
        return (f"the champion was trained on {champion_base_model}, whose tokenizer puts other special tokens around "
                f"each example than {base_model}'s ({named}): per-token losses do not compare")
    return None


def run_evaluation(job: EvaluationJob) -> EvaluationOutcome:
    """Base vs trained (vs champion), all with the same settings."""
    settings = job.settings.for_this_process()
    # One tokenizer lays out the records for every model, the champion too: it is compared only when its
    # base model's tokenizer reads text alike (champion_not_comparable), and its folder's chat template,
    # which that check does not compare, could lay prompts out otherwise (or be missing).
    tokenizer = load_tokenizer(job.base_model_path)
    base, trained = evaluate_against_base(job.base_model_path, job.trained_model_dir, job.records, settings,
                                          job.prompt_format, tokenizer)
    champion = (evaluate_trained(*job.champion, job.records, tokenizer, settings, job.prompt_format)
                if job.champion else None)
    return EvaluationOutcome(settings, base, trained, champion, f"{socket.gethostname()} pid {os.getpid()}")
