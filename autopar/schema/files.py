"""Reading the YAML/JSON description files (cluster profiles, software presets) users write: one
place for the errors a bad file gets, each a PlanError naming the file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autopar.schema.errors import PlanError


def read_mapping(path: Path, what: str, fields: str) -> dict[str, Any]:
    """The mapping held by YAML or JSON file `path` (a `what` file: "cluster", "software"),
    or a PlanError when it cannot be read, does not parse, or holds no mapping (`fields` names
    what it should hold)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanError(f"cannot read {what} file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) if path.suffix.lower() in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise PlanError(f"{what} file {path} is not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'}: "
                        f"{str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{what} file {path} must hold a mapping with {fields}")
    return data
