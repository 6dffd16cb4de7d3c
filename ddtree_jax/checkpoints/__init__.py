"""Checkpoints: Hugging Face config + safetensors reading and writing, files."""
