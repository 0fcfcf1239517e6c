"""The base of every config section: the run's (``config/``) and each algorithm's (``algorithms/*/config.py``),
apart from both, since the run's config validates an algorithm's section through the algorithms' registry."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # NaN and infinity are no setting: refused by field, also because they do not survive the YAML round trip
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
