"""Model stack: HF config -> megatron-core GPTModel (Llama family), HF <-> Megatron mapping, checkpoint I/O."""
