"""Training of DFlash drafters for Hugging Face causal-LM targets."""
