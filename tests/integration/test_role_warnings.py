"""A warning a role process logs (molt_hydra's loggers) reaches the run's terminal, naming the role, once per kind;
the repeats are counted and kept in <output_dir>/role_warnings.jsonl (runtime/role_warnings.py). Before, Ray's
log_to_driver=False left every one in Ray's session log files: a user never saw e.g.
`model.compile_blocks: torch.compile built no graph ...` from a trainer rank. Real Ray, started as a run starts
it (runtime/roles.py `init_ray`)."""

import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class Role:
    def __init__(self):
        import molt_hydra  # noqa: F401 - as every role's class does, through its module

    def warn(self, times: int) -> int:
        import logging

        for i in range(times):
            logging.getLogger("molt_hydra.parallel.trainer").warning("model.compile_blocks: no graph (%d)", i)
        logging.getLogger("vllm.engine").warning("not ours: stays in Ray's log")
        return os.getpid()


def test_a_role_warning_is_printed_once_naming_the_role_and_repeats_are_counted(tmp_path, capsys):
    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
    from _config_helpers import compose_config

    from molt_hydra.runtime.role_warnings import ENV, Shown
    from molt_hydra.runtime.roles import init_ray

    shown = Shown(tmp_path)
    init_ray(OmegaConf.to_object(compose_config([])))
    try:
        pid = ray.get(Role.remote().warn.remote(3), timeout=120)
        shown.role_pids = {"actor rank 0": pid}
    finally:
        ray.shutdown()
        shown.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["actor rank 0: warning: model.compile_blocks: no graph (0)",
                   f"2 more warning(s) of the kinds above: {tmp_path / 'role_warnings.jsonl'}"]
    assert len((tmp_path / "role_warnings.jsonl").read_text().splitlines()) == 3
    assert ENV not in os.environ  # the next run in this process names its own file
