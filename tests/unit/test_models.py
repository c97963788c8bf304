"""The model registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdnet_trainer.config import ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import SimpleCNN, available_models, build_model


def test_resnet18_with_cifar_stem_keeps_32px_resolution():
    model = build_model(ModelConfig(name="resnet18", num_classes=10, cifar_stem=True))
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    features = {}

    def record(module, inputs, output):
        features["layer1"] = output.shape

    model.layer1.register_forward_hook(record)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert features["layer1"][-2:] == (32, 32)


def test_torchvision_models_take_num_classes():
    model = build_model(ModelConfig(name="resnet18", num_classes=7))
    assert model.fc.out_features == 7
    assert "resnet152" in available_models() and "simple_cnn" in available_models()


def test_own_model():
    model = build_model(ModelConfig(name="simple_cnn", num_classes=4, kwargs={"width": 8}))
    assert isinstance(model, SimpleCNN) and model(torch.randn(3, 3, 16, 16)).shape == (3, 4)


def test_unknown_model_suggests_names():
    with pytest.raises(ConfigError, match=r"model.name='resnet51'.*resnet50"):
        build_model(ModelConfig(name="resnet51"))


def test_cifar_stem_needs_a_resnet():
    with pytest.raises(ConfigError, match="model.cifar_stem"):
        build_model(ModelConfig(name="simple_cnn", num_classes=10, cifar_stem=True))


def test_a_classifier_without_a_class_count_is_a_config_error():
    with pytest.raises(ConfigError, match="model.num_classes"):
        build_model(ModelConfig(name="resnet18"))
