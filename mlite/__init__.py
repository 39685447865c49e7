"""mlite: the Megatron Lite training stack for LLM post-training (SFT and GRPO) at scale."""

__version__ = "0.1.0"
