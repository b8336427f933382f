"""base_model: the demo's tiny Llama, or a Hugging Face model directory / hub id."""


import dagster as dg
from pydantic import Field, field_validator

from assets.step_start import start_step
from resources import TesseraStorage
from training_core.base_model import TinyLlamaSpec, build_demo_model, resolve_pretrained
from training_core.data.demo_task import tokenizer_corpus


class BaseModelConfig(dg.Config):
    name_or_path: str = Field(
        "demo", description="'demo' builds a tiny Llama + tokenizer; else a save_pretrained folder, or a hub id "
                            "(org/name or org/name@revision), pinned to the commit it resolves to"
    )
    demo_hidden_size: int = Field(128, gt=0, description="demo only: a multiple of its 4 attention heads")
    demo_layers: int = Field(2, gt=0, description="demo only: number of decoder layers (transformer blocks)")
    demo_seed: int = Field(0, ge=0, le=2**63 - 1, description="weight init seed of the demo model (torch.manual_seed)")

    @field_validator("demo_hidden_size")
    @classmethod
    def _divisible_by_heads(cls, value: int) -> int:
        heads = TinyLlamaSpec.num_attention_heads
        if value % (2 * heads):  # rotary embeddings rotate pairs: each head's size must be even
            raise ValueError(f"demo_hidden_size must be a multiple of {2 * heads} (the demo model's {heads} attention "
                             f"heads, each of an even size for rotary embeddings), got {value}")
        return value


@dg.asset(group_name="model", kinds={"pytorch"})
def base_model(context: dg.AssetExecutionContext, config: BaseModelConfig, storage: TesseraStorage):
    """A model directory `from_pretrained` loads, identified by its content digest."""
    start_step(context)
    if config.name_or_path == "demo":
        spec = TinyLlamaSpec(hidden_size=config.demo_hidden_size, intermediate_size=2 * config.demo_hidden_size,
                             num_hidden_layers=config.demo_layers, seed=config.demo_seed)
        ref = build_demo_model(tokenizer_corpus(), spec, storage.folder("models") / "base")
    else:
        ref = resolve_pretrained(config.name_or_path, storage.base_model_digests)
    context.log.info("base model %s (%s)", ref.name_or_path, ref.digest[:12])
    return dg.Output(
        ref,
        metadata={"name_or_path": ref.name_or_path, "digest": ref.digest, "parameters": ref.parameters,
                  "vocab_size": ref.vocab_size, "source": ref.source},
        data_version=dg.DataVersion(ref.digest),
    )
