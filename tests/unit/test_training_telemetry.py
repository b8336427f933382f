"""Our own bookkeeping around the training loop: start-up split, blocked time, model FLOPs and
parameter counts, core pinning, the per-report loss reduction and the DeepSpeed start-up stand-ins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from training_core.train.checkpointing import TrainingProgress
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig, parse_training_config
from training_core.train.loop import _append_mean_losses, pin_to_own_cores
from training_core.train.model_setup import apply_method, count_parameters
from training_core.data.packing import RowPacker, TokenizedExample
from training_core.train.packed_attention import packed_rows
from training_core.train.telemetry import (
    ModelFlops, StartupClock, StepTimer, model_flops_per_token, resolve_peak_preset,
)


def test_startup_clock_splits_from_the_launch_mark():
    clock = StartupClock(launched_at=100.0)
    clock.mark("ray_worker_group", at=103.0)
    clock.mark("model_load", at=104.5)
    assert clock.durations == {"startup_ray_worker_group_s": 3.0, "startup_model_load_s": 1.5}


def test_step_timer_counts_a_blocked_phase_as_blocked():
    timer = StepTimer()
    never_set = threading.Event()
    with timer.phase("backward"):
        never_set.wait(timeout=0.05)  # blocks without CPU, like a thread waiting on a collective
    assert timer.backward_s >= 0.05
    assert 0.8 * timer.backward_s <= timer.blocked["backward"] <= timer.backward_s
    summary = timer.summary(preset="cpu", world_size=1)
    assert summary["backward_blocked_s"] == timer.blocked["backward"]


class FakeClock:
    """A clock that moves only when the test says so: seconds of "work" without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


STEP_SECONDS = {"data_wait": 0.25, "forward": 0.5, "backward": 1.0, "optimizer": 0.25}  # 2 s, 512 tokens a step


def _train(timer: StepTimer, clock: FakeClock, steps: int, checkpoint_every: int | None = None,
           checkpoint_seconds: float = 0.0, inside: str | None = None) -> None:
    """`steps` steps at the same speed; a checkpoint every `checkpoint_every` steps, after the step
    (as the loop reports) or, with `inside`, in the middle of that phase (a report inside a step)."""
    for step in range(1, steps + 1):
        checkpoint_now = checkpoint_every is not None and step % checkpoint_every == 0
        for phase, seconds in STEP_SECONDS.items():
            with timer.phase(phase):
                clock.advance(seconds / 2)
                if checkpoint_now and phase == inside:
                    with timer.checkpoint():
                        clock.advance(checkpoint_seconds)
                clock.advance(seconds / 2)
        timer.add_batch(512, 512 * 1e6)
        timer.steps += 1
        if checkpoint_now and inside is None:
            with timer.checkpoint():
                clock.advance(checkpoint_seconds)


def _timer(clock: FakeClock, **kwargs) -> StepTimer:
    return StepTimer(clock=clock, cpu_clock=clock, **kwargs)  # all CPU: nothing blocked


@pytest.mark.parametrize("inside", [None, "data_wait", "optimizer"],
                         ids=["between steps", "in data_wait", "in optimizer"])
def test_checkpoints_are_reported_as_checkpoint_s_and_leave_throughput_unchanged(inside):
    # The same 20 steps at the same speed, checkpointing never vs every 5 steps (3 s each): users
    # compare tokens/s and MFU across configurations with different checkpoint intervals.
    rare_clock, often_clock = FakeClock(), FakeClock()
    rare, often = _timer(rare_clock), _timer(often_clock)
    _train(rare, rare_clock, steps=20)
    _train(often, often_clock, steps=20, checkpoint_every=5, checkpoint_seconds=3.0, inside=inside)
    without = rare.summary(preset="h100", world_size=2)
    with_checkpoints = often.summary(preset="h100", world_size=2)

    assert without["tokens_per_s"] == pytest.approx(20 * 512 * 2 / 40.0)
    for metric in ("tokens_per_s", "achieved_flops_per_s", "mfu", "data_stall_fraction"):
        assert with_checkpoints[metric] == pytest.approx(without[metric]), metric
    assert without["checkpoint_s"] == 0.0
    assert with_checkpoints["checkpoint_s"] == pytest.approx(4 * 3.0)
    assert with_checkpoints["elapsed_s"] == pytest.approx(40.0 + 4 * 3.0)  # the loop's wall time, as before
    # Each second counts once: a checkpoint inside a phase is not that phase's time, too.
    for phase, seconds in STEP_SECONDS.items():
        assert with_checkpoints[f"{phase}_s"] == pytest.approx(20 * seconds), phase
        assert with_checkpoints[f"{phase}_blocked_s"] == pytest.approx(0.0), phase


def test_a_checkpoint_counts_once_when_nested_and_up_to_a_summary_taken_inside_it():
    clock = FakeClock()
    timer = _timer(clock)
    _train(timer, clock, steps=2)
    with timer.checkpoint():
        clock.advance(1.0)
        with timer.checkpoint():  # e.g. a report helper that times itself, called from a timed report
            clock.advance(2.0)
        with timer.phase("data_wait"):  # the checkpoint reading the loader's state: checkpoint time
            clock.advance(0.5)
        inside = timer.summary(preset="cpu", world_size=1)
        clock.advance(4.0)
    after = timer.summary(preset="cpu", world_size=1)

    assert inside["checkpoint_s"] == pytest.approx(3.5) and after["checkpoint_s"] == pytest.approx(7.5)
    assert inside["data_wait_s"] == after["data_wait_s"] == pytest.approx(2 * STEP_SECONDS["data_wait"])
    assert inside["tokens_per_s"] == pytest.approx(after["tokens_per_s"]) == pytest.approx(2 * 512 / 4.0)


def test_device_work_queued_by_the_steps_is_training_time_not_checkpoint_time():
    # On GPU the steps only queue kernels; the checkpoint's first device-to-host copy would wait for
    # them. The timer waits for the device before it starts the checkpoint's clock.
    clock = FakeClock()
    queued = []
    timer = _timer(clock, synchronize=lambda: clock.advance(queued.pop() if queued else 0.0))
    _train(timer, clock, steps=4)
    queued.append(1.0)  # kernels still running when the loop reaches the checkpoint
    with timer.checkpoint():
        clock.advance(3.0)
    queued.append(0.5)  # and before the summary
    summary = timer.summary(preset="cpu", world_size=1)
    assert summary["checkpoint_s"] == pytest.approx(3.0)
    assert summary["elapsed_s"] == pytest.approx(8.0 + 1.0 + 3.0 + 0.5)
    assert summary["tokens_per_s"] == pytest.approx(4 * 512 / (8.0 + 1.0 + 0.5))


EOS = 2


def _packed_batch(pad_token_id: int) -> dict[str, torch.Tensor]:
    """Two rows of 16 as the loop trains them: examples of 6 and 4 tokens then 6 of padding; one
    example of 12 then 4 of padding."""
    packer = RowPacker(seq_len=16, pad_token_id=pad_token_id)
    for prompt, response in ([1, 5, 6], [7, 8, EOS]), ([1, 9], [10, EOS]), ([1, *range(11, 19)], [20, 21, EOS]):
        packer.add(TokenizedExample(prompt_ids=prompt, response_ids=response), describe=lambda: "example")
    packer.finish()
    rows = packer.take_rows()
    return packed_rows(rows["input_ids"], rows["labels"])


# 1000 frozen and 10 trainable weights that multiply, 2 layers of attention 8 wide.
TINY_FLOPS = ModelFlops(frozen_matmul_weights=1000, trainable_matmul_weights=10, layers=2, attention_width=8)
# By hand: 22 tokens of examples × (4·1010 + 2·10), plus attention 12·L·d·Σ l² over examples of 6, 4, 12 tokens.
HAND_TOKENS, HAND_FLOPS = 22, 22 * 4060 + 12 * 2 * 8 * (6**2 + 4**2 + 12**2)


@pytest.mark.parametrize("pad_token_id", [0, EOS], ids=["own pad token", "pad is eos"])
def test_a_packed_batch_counts_its_examples_tokens_and_attention_within_each_example(pad_token_id):
    # Padding is no model work, and in packed rows a token attends only within its own example (as
    # flash varlen computes it): counting every row's width of tokens and of attention inflates MFU.
    batch = _packed_batch(pad_token_id)
    tokens, flops = TINY_FLOPS.of_packed_rows(batch["labels"].numpy(), batch["position_ids"].numpy())
    assert (tokens, flops) == (HAND_TOKENS, HAND_FLOPS)


def test_throughput_and_mfu_come_from_the_batches_trained():
    clock = FakeClock()
    timer = _timer(clock)
    batch = _packed_batch(pad_token_id=0)
    for _ in range(3):
        with timer.phase("forward"):
            clock.advance(2.0)
        timer.add_batch(*TINY_FLOPS.of_packed_rows(batch["labels"].numpy(), batch["position_ids"].numpy()))
    summary = timer.summary(preset="h100", world_size=2)
    assert summary["tokens_per_s"] == pytest.approx(3 * HAND_TOKENS * 2 / 6.0)
    assert summary["achieved_flops_per_s"] == pytest.approx(3 * HAND_FLOPS * 2 / 6.0)
    assert summary["model_flops_per_token"] == pytest.approx(HAND_FLOPS / HAND_TOKENS)
    assert summary["mfu"] == pytest.approx(3 * HAND_FLOPS / 6.0 / 989e12)


def test_a_sequence_of_one_example_costs_what_the_per_token_formula_says():
    # bench/gpu_mfu.py trains rows of one example each, its whole width: the same figure either way.
    assert model_flops_per_token(1000, 10, 2, 8, 16) == TINY_FLOPS.per_token(16) == 4060 + 12 * 2 * 8 * 16
    full_row = np.array([[*range(1, 16), EOS]])
    tokens, flops = TINY_FLOPS.of_packed_rows(full_row, np.arange(16)[None, :])
    assert (tokens, flops) == (16, 16 * TINY_FLOPS.per_token(16))


def _affinity_after_pinning(*args) -> set[int]:
    seen: list[set[int]] = []

    def pin_and_read() -> None:  # in its own thread: sched_setaffinity(0) pins the calling thread only
        pin_to_own_cores(*args)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=pin_and_read)
    thread.start()
    thread.join()
    return seen[0]


def _tiny_llama(head_dim: int | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="eager",
        **({"head_dim": head_dim} if head_dim else {})))


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128,
                                      attn_implementation="eager"))


TINY_MODELS = {
    "llama head_dim=hidden/heads": lambda: _tiny_llama(None),
    "llama heads×head_dim≠hidden": lambda: _tiny_llama(32),
    "gpt2 Conv1D": _tiny_gpt2,  # its linear layers are transformers' Conv1D, not torch.nn.Linear
}
METHODS = {
    "full": {"method": "full"},
    "lora": {"method": "lora", "lora": {"r": 8}},
    "lora+modules_to_save": {"method": "lora", "lora": {"r": 8, "modules_to_save": ["embed_tokens", "lm_head"]}},
}


@pytest.mark.parametrize(("method", "architecture"), [
    pytest.param(METHODS[method], architecture, id=f"{method}-{architecture}")
    for method in METHODS for architecture in TINY_MODELS
    # GPT-2 ties lm_head to its embeddings, and names them otherwise: no separate copies to count.
    if not (method == "lora+modules_to_save" and architecture.startswith("gpt2"))
])
def test_model_flops_per_token_match_what_torch_counts_for_a_training_step(method, architecture):
    # MFU is achieved / peak FLOPs: an overcount (embeddings, the frozen originals PEFT keeps beside
    # modules_to_save copies, attention width taken as hidden_size) inflates it; an undercount
    # (linear layers of another class) deflates it.
    from tests.unit.flop_support import estimated_over_measured_flops

    ratio = estimated_over_measured_flops(apply_method(TINY_MODELS[architecture](), TrainingConfig(**method)))
    # LoRA alone overcounts a little: no activation gradient flows below the first adapted layer.
    assert 0.99 <= ratio <= 1.08, ratio


def test_parameter_counts_leave_out_unused_copies_and_unpack_4_bit_weights():
    plain = apply_method(_tiny_llama(None), TrainingConfig(method="lora", lora={"r": 8}))
    with_copies = apply_method(_tiny_llama(None), TrainingConfig(
        method="lora", lora={"r": 8, "modules_to_save": ["embed_tokens", "lm_head"]}))
    assert count_parameters(with_copies)[0] == count_parameters(plain)[0]
    assert count_parameters(with_copies)[1] > count_parameters(plain)[1]

    class Params4bit(torch.nn.Parameter):  # stands in for bitsandbytes' class: two weights per stored byte
        pass

    packed = torch.nn.Module()
    packed.weight = Params4bit(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)
    assert count_parameters(packed) == (16, 0)


@pytest.mark.parametrize(("preset", "device", "expected"), [
    ("auto", "NVIDIA H100 80GB HBM3", "h100"), ("auto", "NVIDIA H200", "h200"),
    ("auto", "NVIDIA A100-SXM4-80GB", "a100"), ("auto", "NVIDIA L4", "cpu"), ("auto", None, "cpu"),
    ("a100", "NVIDIA H100 80GB HBM3", "a100"),  # an explicit preset wins (e.g. a clock-limited part)
])
def test_the_auto_peak_preset_reads_the_gpus_name(preset, device, expected):
    assert resolve_peak_preset(preset, device) == expected


def test_mfu_is_reported_only_against_a_known_peak():
    timer = StepTimer()
    timer.add_batch(1000, 1000 * 1e6)
    assert "mfu" not in timer.summary(preset="cpu", world_size=2)
    on_h100 = timer.summary(preset="h100", world_size=2)
    assert on_h100["peak_flops_per_s"] == 989e12
    assert on_h100["mfu"] == pytest.approx(on_h100["achieved_flops_per_s"] / (2 * 989e12))


@pytest.mark.parametrize(("values", "message"), [
    ({"peak_flops_preset": "h100"}, "peak_flops_preset='h100' is a GPU's peak: it needs use_gpu=True"),
    ({"weight_decay": float("inf")}, "weight_decay"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping"),
])
def test_telemetry_and_optimizer_settings_that_cannot_apply_are_rejected(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_training_config(values)


def test_each_local_rank_gets_its_own_cores():
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs 2 usable cores")
    assert _affinity_after_pinning(0, 2, 1) == {usable[0]}
    assert _affinity_after_pinning(1, 2, 1) == {usable[1]}
    # More ranks than cores: leave the scheduler alone rather than stack ranks on one core.
    assert _affinity_after_pinning(0, len(usable) + 1, 1) == set(usable)


@pytest.fixture()
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_losses_since_the_last_report_are_appended_with_their_step_numbers(single_process_group):
    progress = TrainingProgress(step=12, loss_history=[(10, 2.0)])
    pending, skipped = [torch.tensor(1.5), torch.tensor(1.25)], [False, False]
    model, config = torch.nn.Linear(2, 2), TrainingConfig()
    _append_mean_losses(progress, pending, skipped, model, config)
    assert progress.loss_history == [(10, 2.0), (11, 1.5), (12, 1.25)]
    assert pending == [] and skipped == []
    _append_mean_losses(progress, pending, skipped, model, config)  # nothing new: nothing appended
    assert len(progress.loss_history) == 3


def test_a_single_workers_skipped_update_fails_the_run_naming_its_step(single_process_group):
    """One rank alone sums one skip per skipped step: a threshold above one would pass it silently."""
    from training_core.errors import TrainingDivergedError

    progress = TrainingProgress(step=6, loss_history=[(4, 2.0)])
    pending, skipped = [torch.tensor(1.5), torch.tensor(1.25)], [False, True]
    with pytest.raises(TrainingDivergedError, match=r"the gradients of step 6 were inf or NaN"):
        _append_mean_losses(progress, pending, skipped, torch.nn.Linear(2, 2), TrainingConfig())
    assert progress.loss_history == [(4, 2.0)]  # the diverged steps never reach the curve

def test_contiguous_gradient_buffer_only_for_full_fine_tuning():
    zero = lambda method: build_deepspeed_config(  # noqa: E731
        TrainingConfig(method=method, zero_stage=2), world_size=1)["zero_optimization"]
    assert zero("full")["contiguous_gradients"] is True
    assert zero("lora")["contiguous_gradients"] is False


@pytest.mark.integration  # a real DeepSpeed engine in a subprocess
def test_zero2_step_runs_without_importing_muon_inductor_or_mlflow(tmp_path):
    """The Muon stand-ins keep Inductor out of a ZeRO-2 worker (1 s of start-up), importing
    DeepSpeed through `import_deepspeed` keeps MLflow out (0.85 s), and training works."""
    script = textwrap.dedent(f"""
        import os, sys
        os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import torch
        from training_core.train.deepspeed_startup import import_deepspeed, skip_unused_deepspeed_startup
        deepspeed = import_deepspeed()
        assert "mlflow" not in sys.modules
        skip_unused_deepspeed_startup(use_gpu=False)
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
            config={{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4,
                     "zero_optimization": {{"stage": 2, "contiguous_gradients": False}},
                     "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}},
            dist_init_required=False)
        x = torch.randn(4, 8)
        losses = []
        for _ in range(5):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
        assert "torch._inductor.compile_fx" not in sys.modules
        assert "mlflow" not in sys.modules
        import mlflow  # still importable afterwards
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_dagster_launch_can_name_the_peak_for_mfu_and_defaults_to_reading_the_gpu():
    from assets.training_assets import TrainingRunConfig

    assert TrainingRunConfig().training_config().peak_flops_preset == "auto"
    launched = TrainingRunConfig(use_gpu=True, peak_flops_preset="a100").training_config()
    assert launched.peak_flops_preset == "a100" and launched.use_gpu
