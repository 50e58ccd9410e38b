"""vllm-loop: looped and latent-reasoning LMs in vLLM."""
