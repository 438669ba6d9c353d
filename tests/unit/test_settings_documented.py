"""docs/configuration.md's table names every setting of ``layertap.settings.Settings``, and nothing else,
each with the environment variable that sets it."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from layertap.settings import Settings

TABLE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def settings_of(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of ``model``'s leaf settings (a nested group's fields under its name)."""
    names = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names += settings_of(field.annotation, f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names


def documented() -> dict[str, str]:
    """Each setting a row of the table names -> the env cell of its row. A row may name several
    of one group: ``worker.device`` / ``dtype`` (the later ones bare)."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([a-z_.]+)`", cells[0])
        group = names[0].rpartition(".")[0]
        for name in names:
            rows[name if "." in name or not group else f"{group}.{name}"] = cells[1]
    return rows


def test_every_setting_has_a_row_and_every_row_a_setting():
    rows = documented()
    names = settings_of(Settings)
    assert sorted(set(names) - set(rows)) == [], "settings with no row in docs/configuration.md"
    assert sorted(set(rows) - set(names)) == [], "rows of docs/configuration.md naming no setting"


def test_each_row_gives_the_variable_that_sets_it():
    for name, env in documented().items():
        variable = "LAYERTAP_" + name.upper().replace(".", "__")
        group = variable.rpartition("__")[0]
        # a row of several names gives the first in full and the others as ``__FIELD`` or all as ``GROUP__...``
        assert (variable in env or f"__{name.rpartition('.')[2].upper()}" in env
                or f"{group}__..." in env), (name, env)
