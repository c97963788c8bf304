"""Model registry: torchvision classifiers by name plus this project's own small models and the
GPT language model."""

from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.models.registry import available_models, build_model
from sdnet_trainer.models.simple_cnn import SimpleCNN

__all__ = ["GPT", "SimpleCNN", "available_models", "build_model"]
