"""Checkpoint readers (Hugging Face, mamba_ssm, Codestral-style) and orbax I/O."""
