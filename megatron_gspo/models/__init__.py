"""The Qwen3-MoE model on Megatron-core: built for one rank of a layout (``model``), its local
layers, grouped experts, RoPE and router losses, the Transformer Engine facade (``te``), the
pipeline-aware forward and backward (``forward``), and the Hugging Face format (``hf_config``,
``hf_io``, ``hf_mapping``)."""
