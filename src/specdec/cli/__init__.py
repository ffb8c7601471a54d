"""The `specdec` command (also `python -m specdec`): one module per command group. A command that
speculates parses its options into a `SpecConfig` (`common.spec_config`), builds through
`speculation.build`, runs and renders; no drafter is assembled here."""

from __future__ import annotations

# each module registers its commands, in the order `specdec --help` lists them
from . import generate
from . import chat
from . import training
from . import models
from . import bench
from . import serve  # noqa: F401,I001
from . import reproduce  # noqa: F401,I001
from .common import _drafter_weights, _tokenizer, app, parse_bytes  # noqa: F401 (the app; the rest: tests)
from .generate import _generate_batch  # noqa: F401 (tests)
from .serve import _home_as_tilde  # noqa: F401 (tests)
from .training import distill_drafter_command  # noqa: F401 (tests)


def main() -> None:
    app()
