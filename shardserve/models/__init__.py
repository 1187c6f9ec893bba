"""Model definitions, a module per family; registry.py says which class builds each architecture."""

from shardserve.models.registry import (SUPPORTED_ARCHITECTURES, UnsupportedArchitecture, model_class,
                                        resolve_architecture)

__all__ = ["SUPPORTED_ARCHITECTURES", "UnsupportedArchitecture", "model_class", "resolve_architecture"]
