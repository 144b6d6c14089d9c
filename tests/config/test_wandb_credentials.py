"""An online W&B run without credentials W&B accepts is refused at validation (logging/rules.py), naming the key, the
reason and the fix. Before, `logger.wandb.mode=online` with no API key anywhere passed `dry_run=true`, and the run
failed at wandb.init (or waited at W&B's login prompt) once its engines and trainer were up.

The credentials are wandb's own lookup (WANDB_API_KEY, the .netrc that `wandb login` writes): each test points both at
files of its own, so the machine's real ones never decide it."""

from __future__ import annotations

import os
import subprocess

import pytest

from _config_helpers import MOLT_RUN, PLAN_HEADER, REPO
from molt_hydra.cli import EXIT_CONFIG_ERROR
from test_validation import assert_fires, config_errors

KEY = "k" * 40  # the shortest API key W&B's format check takes (40 characters of A-Z, digits, _)
ONLINE = ["logger.wandb.mode=online"]


def netrc_with(path, key: str | None) -> str:
    """A .netrc holding `key` for api.wandb.ai, as `wandb login` writes it (none: an empty file)."""
    path.write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n" if key else "")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", netrc_with(tmp_path / "netrc", None))
    return tmp_path


def test_online_without_any_key_is_refused(no_credentials):
    assert_fires(ONLINE, "logger.wandb.mode", "online, but W&B finds no API key")
    line = next(l for l in config_errors(ONLINE) if l.startswith("logger.wandb.mode: "))
    fix = line.split(" Fix: ", 1)[1]
    assert "WANDB_API_KEY" in fix and "wandb login" in fix and "logger.wandb.mode=offline" in fix, line


@pytest.mark.parametrize("mode", ["offline", "disabled", "auto"])
def test_modes_that_need_no_key_pass_without_one(no_credentials, mode):
    assert config_errors([f"logger.wandb.mode={mode}"]) == []


def test_online_with_a_netrc_entry_passes(no_credentials, monkeypatch):
    monkeypatch.setenv("NETRC", netrc_with(no_credentials / "netrc", KEY))
    assert config_errors(ONLINE) == []


def test_online_with_an_api_key_passes(no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    assert config_errors(ONLINE) == []


@pytest.mark.parametrize("mode", ["online", "auto"])  # auto: online because the key is set (logging/sinks.py)
def test_a_key_wandb_refuses_is_named(no_credentials, monkeypatch, mode):
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    assert_fires([f"logger.wandb.mode={mode}"], "logger.wandb.mode", "API key must have 40+ characters, has 3")


class _InitCalled(Exception):
    """Raised by the stand-in for wandb.init: an online W&B run cannot start here (no network)."""


def _auto_mode_starts(monkeypatch, tmp_path) -> str:
    """The mode MetricSinks hands wandb.init under logger.wandb.mode=auto, wandb.init stood in for (it records it)."""
    import wandb

    from molt_hydra.logging.sinks import MetricSinks

    def init_stand_in(**kw):
        raise _InitCalled(kw["mode"])

    monkeypatch.setattr(wandb, "init", init_stand_in)
    with pytest.raises(_InitCalled) as called:
        MetricSinks(tmp_path / "run", run_name="r", config={}, wandb_mode="auto")
    return called.value.args[0]


def test_auto_is_online_after_wandb_login(no_credentials, monkeypatch):
    """Before: `wandb login` (its .netrc entry) without WANDB_API_KEY left logger.wandb.mode=auto offline, though the
    docs say online with `wandb login`; a key W&B refuses there passed validation."""
    monkeypatch.setenv("NETRC", netrc_with(no_credentials / "netrc", KEY))
    assert _auto_mode_starts(monkeypatch, no_credentials) == "online"
    assert config_errors(["logger.wandb.mode=auto"]) == []
    monkeypatch.setenv("NETRC", netrc_with(no_credentials / "netrc", "abc"))
    assert_fires(["logger.wandb.mode=auto"], "logger.wandb.mode", "auto, online as W&B finds credentials, but W&B "
                 "refuses the credentials it finds")


def test_auto_is_offline_without_credentials(no_credentials, monkeypatch):
    assert _auto_mode_starts(monkeypatch, no_credentials) == "offline"


def test_cli_refuses_online_without_credentials(tmp_path):
    """The real `molt-run`, in an environment without any W&B credentials: exit 2, the key named, no plan."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "HYDRA_FULL_ERROR"}
    env.update(HOME=str(tmp_path), NETRC=netrc_with(tmp_path / "netrc", None))
    args = [str(MOLT_RUN), *ONLINE, "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_CONFIG_ERROR, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and PLAN_HEADER not in p.stdout, p.stdout + p.stderr
    assert "- logger.wandb.mode: online, but W&B finds no API key" in p.stderr, p.stderr


def test_under_another_wandb_release_the_check_steps_aside(no_credentials, monkeypatch):
    """The lookup reaches into wandb's private modules (tested on 0.31): under another release no check is made, and
    wandb.init finds the key or not as before. Was: every online run (auto with WANDB_API_KEY set) refused to start
    with a VersionError traceback."""
    import molt_hydra.compat as compat

    monkeypatch.setattr(compat, "installed", lambda *dists: ("wandb", "0.99.0"))
    assert config_errors(ONLINE) == []
