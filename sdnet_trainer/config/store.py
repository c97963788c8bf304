"""Registers the typed schema and the recipes with Hydra's ConfigStore.

Hydra maps config groups to folders on its search path; ``recipes/`` is a top-level folder with a
different name, so each recipe is stored explicitly in the ``recipe`` group under the ``_global_``
package: ``+recipe=NAME`` then loads ``recipes/NAME.yaml`` over the root config.
"""

from __future__ import annotations

from importlib import resources

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sdnet_trainer.config.schema import Config

SCHEMA_NAME = "sdnet_schema"
CONFIG_MODULE = "sdnet_trainer.configs"
RECIPE_MODULE = "sdnet_trainer.recipes"


def recipe_names() -> list[str]:
    return sorted(
        p.name[: -len(".yaml")]
        for p in resources.files(RECIPE_MODULE).iterdir()
        if p.name.endswith(".yaml")
    )


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=Config)
    recipes = resources.files(RECIPE_MODULE)
    for name in recipe_names():
        node = OmegaConf.create(recipes.joinpath(f"{name}.yaml").read_text())
        store.store(group="recipe", name=name, node=node, package="_global_")
