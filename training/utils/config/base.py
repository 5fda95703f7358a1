"""The strict pydantic base and the bounded number type every config model is built from.

Configs reject unknown keys and validate at construction and on assignment, so a typo or an
impossible value fails before any model is loaded.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A float that must be finite. A `gt=0` bound lets inf through (nan fails any bound); fields whose inf would
poison the run (a learning rate, a loss weight, a timeout that reaches aiohttp or timedelta) take this type."""
