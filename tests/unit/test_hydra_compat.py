"""compat/hydra.py: Hydra's command-line parser still reads what molt-run's early config check reads; another
hydra-core release is refused naming both."""

from __future__ import annotations

from importlib import metadata

import pytest

from molt_hydra.compat.hydra import get_args_parser


def test_hydras_parser_gives_the_flags_molt_run_reads():
    args = get_args_parser().parse_args(["-m", "+recipe=x", "a.b=1", "--config-dir", "/tmp/conf"])
    assert args.multirun and args.overrides == ["+recipe=x", "a.b=1"] and args.config_dir == "/tmp/conf"
    assert not (args.help or args.hydra_help or args.info or args.shell_completion or args.config_name
                or args.config_path)


def test_another_release_is_refused(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda dist: "1.4.0")
    with pytest.raises(RuntimeError, match=r"command-line check \(molt_hydra/compat/hydra.py\) is written for hydra-core 1\.3\.x; "
                                           r"hydra-core 1\.4\.0 is installed"):
        get_args_parser()
