"""A YAML file read into a pydantic model, every problem one line that names the file and the field."""

from __future__ import annotations

from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def load_yaml_model(path: str, model: type[M], error: type[ValueError], what: str) -> M:
    """`model` validated from the YAML at `path` (an empty file is an empty mapping); raises `error` with a message
    naming the file: unreadable (`what` says which kind of file), not YAML, or each invalid field by its dotted
    path."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise error(f"cannot read the {what} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML: {e}") from None
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as e:
        lines = [f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in e.errors()]
        raise error(f"{path}: " + "; ".join(lines)) from None
