"""Image tokenizers and their interface (`base`). `vq`: LlamaGen's VQ (VQ-16 / VQ-8 and small variants)."""
