"""Model registry: every supported family is built by one decoder class."""

from shardserve.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}
