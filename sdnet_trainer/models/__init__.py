"""Model registry: torchvision classifiers by name plus this project's own small models and the
language models (the GPT and the Llama family)."""

from sdnet_trainer.models import families  # noqa: F401 - registers the built-in families
from sdnet_trainer.models.build import build_model
from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.models.llama import Llama
from sdnet_trainer.models.lora import init_adapters
from sdnet_trainer.models.registry import available_models
from sdnet_trainer.models.simple_cnn import SimpleCNN

__all__ = ["GPT", "Llama", "SimpleCNN", "available_models", "build_model", "init_adapters"]
