"""Every config field says what it does: the description is the flag's --help and its row in
docs/configuration.md, so a field without one is a flag nobody can look up."""

from sluiceway.flows.config import RunConfig


def test_every_field_of_every_part_has_a_description():
    missing = [f"RunConfig.{group}" for group, info in RunConfig.model_fields.items() if not info.description]
    for group, info in RunConfig.model_fields.items():
        missing += [f"{group}.{name}" for name, f in info.annotation.model_fields.items() if not f.description]
    assert not missing, missing
