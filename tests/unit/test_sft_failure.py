"""A failed job=sft is one message naming the rank and the cause, printed last, exit 4; the rank's traceback goes to
<output_dir>/failure.txt (runtime/entrypoint.py `_run_sft`). Before, the torch.multiprocessing error reached Hydra's
report with the rank's whole traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))
from _config_helpers import compose_config  # noqa: E402
from molt_hydra.runtime import entrypoint  # noqa: E402
from molt_hydra.runtime.preemption import PreemptionNotice  # noqa: E402
from molt_hydra.runtime.watchdog import EXIT_FAILED  # noqa: E402

RANK_TRACEBACK = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
                  '  File "sft.py", line 9, in _sft_rank\nValueError: row 7 has no reply')


@pytest.mark.parametrize("error,last", [
    (ProcessRaisedException(RANK_TRACEBACK, 1, 4321),
     "Run failed: sft trainer rank 1: ValueError: row 7 has no reply."),
    (ProcessExitedException("process 0 terminated with signal SIGKILL", 0, 99, -9, "SIGKILL"),
     "Run failed: sft trainer rank 0: process 0 terminated with signal SIGKILL."),
    (TimeoutError("2 ranks of _sft_rank did not finish within 3600s"),
     "Run failed: sft trainer: 2 ranks of _sft_rank did not finish within 3600s."),
])
def test_a_failed_sft_rank_is_one_message_naming_it(error, last, tmp_path, monkeypatch, capsys):
    import molt_hydra.runtime.sft_job as sft_job

    def fails(cfg, resume_from, notice, record):
        raise error

    monkeypatch.setattr(sft_job, "run_sft_job", fails)
    cfg = OmegaConf.to_object(compose_config(["+recipe=tiny_vlm_colors_warm", f"checkpoint.dir={tmp_path / 'ckpt'}"],
                                             output_dir=str(tmp_path)))
    with pytest.raises(SystemExit) as e:
        entrypoint._run_sft(cfg, None, PreemptionNotice(cfg.output_dir), {})
    assert e.value.code == EXIT_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == last and "Traceback" not in "\n".join(lines)
    assert lines[1] == "Last checkpoint: none (the run starts from step 0 again)"
    assert lines[-1] == f"Details (traceback): {tmp_path / 'failure.txt'}"
    assert type(error).__name__ in (tmp_path / "failure.txt").read_text()
