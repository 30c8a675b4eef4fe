"""Logging set-up shared by the driver and the Ray workers."""

import logging

__all__ = ["QUIET_LOGGERS", "setup_logging"]

# Third-party loggers that narrate model loading; quiet unless --log-level DEBUG.
QUIET_LOGGERS = ("diffusers", "transformers", "urllib3", "filelock", "httpx")


def setup_logging(level: str, *, worker: bool = False) -> None:
    """One log format for the driver (or a worker). Workers log warnings only unless ``level`` is DEBUG, and the
    loaders of diffusers and transformers stay quiet (no weight-loading bars, no per-rank start-up lines)."""
    effective = level if (not worker or level == "DEBUG") else "WARNING"
    logging.basicConfig(level=effective, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=worker)
    if level == "DEBUG":
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
