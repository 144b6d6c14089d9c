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
    with pytest.raises(RuntimeError, match=r"command-line check \(molt_hydra/compat/hydra.py\) is written for "
                                           r"hydra-core 1\.3\.x; "
                                           r"hydra-core 1\.4\.0 is installed"):
        get_args_parser()


def test_the_override_grammar_gives_each_number_as_written():
    """written_scalars: an unquoted number or bool that is a value of its own, with its place; not one inside quotes
    or a longer unquoted string."""
    from molt_hydra.compat.hydra import written_scalars

    assert written_scalars("name='1.10',2.0,a1.10,choice(1e3, true)") == [
        ("2.0", 12, 14), ("1e3", 29, 31), ("true", 34, 37)]


def test_hydras_defaults_list_gives_each_composed_configs_source(tmp_path):
    """composed_files: (package, config path, source) of the configs a composition merges, a --config-dir recipe's
    source its directory."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from molt_hydra.compat.hydra import composed_files
    from molt_hydra.config.store import CONF_DIR, register

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\nname: mine\n")
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        files = composed_files("config", ["+recipe=mine", "model=qwen3_4b", f"hydra.searchpath=['file://{tmp_path}']"])
    assert ("", "recipe/mine", f"file://{tmp_path}") in files
    assert ("model", "model/qwen3_4b", f"file://{CONF_DIR}") in files and ("", "config", f"file://{CONF_DIR}") in files
