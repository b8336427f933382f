"""Token-weighted step loss over two real ranks (gloo on CPU): each rank trains a different number of
tokens, and every rank must weight its loss by the tokens of the whole global batch, not its own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers.loss.loss_utils import ForCausalLMLoss

from training_core.data.packing import IGNORE_INDEX
from training_core.train.loss_weighting import loss_to_backpropagate, step_token_count

VOCAB, WIDTH, WORLD_SIZE = 16, 8, 2
# Each rank's two micro-batches (one row each) as the index of its first trained label: rank 0 trains
# 7 + 4 tokens, rank 1 trains 1 + 0 (the first label of a row is never trained: 0 trains WIDTH - 1).
FIRST_TRAINED = {0: [0, 4], 1: [7, WIDTH]}
GLOBAL_BATCH_TOKENS = 7 + 4 + 1 + 0


def _micro_batch(rank: int, index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * rank + index)
    input_ids = torch.randint(0, VOCAB, (1, WIDTH), generator=generator)
    labels = input_ids.clone()
    labels[:, :FIRST_TRAINED[rank][index]] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def _bigram_model() -> torch.nn.Embedding:
    """A causal LM in its simplest form: each token's logits for the next, the same on every rank."""
    torch.manual_seed(0)
    return torch.nn.Embedding(VOCAB, VOCAB)


def _train_one_step(rank: int, store_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        micro_batches = [_micro_batch(rank, index) for index in range(2)]
        tokens = step_token_count(micro_batches, world_size=WORLD_SIZE, device="cpu")
        model, step_loss = _bigram_model(), torch.zeros(())
        for batch in micro_batches:
            loss = ForCausalLMLoss(model(batch["input_ids"]), batch["labels"], VOCAB, num_items_in_batch=tokens)
            loss_to_backpropagate(loss, WORLD_SIZE).backward()  # DeepSpeed's backward(scale_wrt_gas=False)
            step_loss += loss.detach()
        gradient = model.weight.grad
        dist.all_reduce(gradient)  # DeepSpeed's gradient reduction over ranks: their mean
        gradient /= WORLD_SIZE
        dist.all_reduce(step_loss)  # the step's loss as the loop logs it: every rank's summed
        torch.save({"tokens": tokens, "gradient": gradient, "step_loss": step_loss}, f"{results}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_with_uneven_trained_tokens_weight_each_token_by_the_global_batch(tmp_path):
    mp.spawn(_train_one_step, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(WORLD_SIZE)]

    # Every rank counts the global batch's tokens: the sum over ranks, not its own nor the largest.
    assert [result["tokens"].item() for result in ranks] == [GLOBAL_BATCH_TOKENS] * WORLD_SIZE

    # The step is the token mean over the whole global batch, as if one process had trained it.
    model = _bigram_model()
    batches = [_micro_batch(rank, index) for rank in range(WORLD_SIZE) for index in range(2)]
    logits = model(torch.cat([batch["input_ids"] for batch in batches]))
    whole = ForCausalLMLoss(logits, torch.cat([batch["labels"] for batch in batches]), VOCAB)  # token mean
    whole.backward()
    for result in ranks:
        assert result["step_loss"].item() == pytest.approx(whole.item(), rel=1e-6)
        torch.testing.assert_close(result["gradient"], model.weight.grad, rtol=1e-5, atol=1e-7)
