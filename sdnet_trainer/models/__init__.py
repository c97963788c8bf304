"""Model registry: torchvision classifiers by name plus this project's own small models."""

from sdnet_trainer.models.registry import available_models, build_model
from sdnet_trainer.models.simple_cnn import SimpleCNN

__all__ = ["SimpleCNN", "available_models", "build_model"]
