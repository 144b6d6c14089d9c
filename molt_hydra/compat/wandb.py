"""W&B: what this project reaches into.

`x_transaction_log_flush_interval`, a private wandb setting (wandb >= 0.2x's wandb-core; tested: 0.31.0): how often the
run's records reach its `.wandb` file, 15 s by default. A Slurm job that is requeued, preempted, timed out or cancelled
is killed together with wandb-core (the step's SIGTERM reaches it too), and what it had not written is lost: seen, the
last 4 steps of a requeued point, 2 of them before its checkpoint, so its resume never logged them again. Written every
second instead, a kill loses at most the last second. A wandb without the setting keeps its own interval.
`wandb/latest-run`, the link wandb leaves in a run's directory to its last run's files, which hold
`run-<id>.wandb` (`last_run_id`; the directory's own name may end in `-1` when a run restarts within a second).
`wandb.sdk.lib.wbauth.authenticate_session` and the settings singleton (`wandb.sdk.wandb_setup.singleton`): the lookup
of an API key `wandb.init` makes for an online run (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the .netrc entry of its
host that `wandb login` writes, a settings file's api_key), without its prompt (`api_key`; tested: 0.31.0; under
another wandb release no lookup is made: credentials are WANDB_API_KEY alone, as before it, and `wandb.init` finds them
or not as it always has).
"""

from __future__ import annotations

import os
from pathlib import Path

from molt_hydra.compat import VersionError, written_for

FLUSH_S = 1.0
SUPPORTED = {"wandb": ("0.31",)}


def settings():
    """The `wandb.Settings` every molt_hydra run starts W&B with."""
    import wandb

    known = getattr(wandb.Settings, "model_fields", {})
    return wandb.Settings(**({"x_transaction_log_flush_interval": FLUSH_S}
                             if "x_transaction_log_flush_interval" in known else {}))


def last_run_id(output_dir: Path) -> str | None:
    """The id of the last W&B run started in `output_dir`, from the `run-<id>.wandb` file its `wandb/latest-run`
    link holds. None where W&B never ran."""
    link = Path(output_dir) / "wandb" / "latest-run"
    if link.is_symlink():
        files = sorted(link.glob("run-*.wandb"))
    else:  # a directory copied without its links (cp -rL, an archive): the newest run's, by its directory's start time
        files = sorted(Path(output_dir).glob("wandb/*run-*/run-*.wandb"),
                       key=lambda f: f.parent.name.partition("run-")[2])[-1:]
    return files[0].stem.removeprefix("run-") if files else None


def api_key() -> tuple[bool, str | None]:
    """(whether an online W&B run started here finds credentials, why it could not take them: its `wandb.init` then
    fails, or waits at W&B's login prompt, once the run's roles are up; None when it takes them), looked up as
    wandb.init looks them up. logger.wandb.mode=auto is online where it finds some (logging/sinks.py)."""
    try:
        written_for("molt-run's W&B credentials check", "wandb", SUPPORTED)
    except VersionError:  # its private lookup may differ there (was: every online run refused to start)
        return bool(os.environ.get("WANDB_API_KEY")), None
    from wandb.errors import AuthenticationError
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import wbauth

    settings = wandb_setup.singleton().settings
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    try:
        found = wbauth.authenticate_session(host=host, source="molt-run", prompt=False, update_session=False)
    except AuthenticationError as e:  # a key in a form W&B refuses (or two sources that exclude each other)
        return True, f"W&B refuses the credentials it finds ({str(e).rstrip('.')})."
    return (True, None) if found else (False, f"W&B finds no API key for {host.url} here (no WANDB_API_KEY, no entry "
                                              "in ~/.netrc from `wandb login`, no api_key in its settings).")
