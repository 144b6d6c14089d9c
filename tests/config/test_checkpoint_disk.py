"""The plan sizes a resumable checkpoint (fp32 weights + AdamW's two fp32 moments = 12 bytes a parameter) against the
free disk at checkpoint.dir: a run whose first save cannot fit is refused before it starts (the H200 lost a 4.9 B
MoE run to a 64 GB disk at its final save); a dry run shows it, since it may plan for another machine's disk.
checkpoint.save_steps=0 writes none, and then the knobs that shape checkpoints are refused."""

from __future__ import annotations

import json
import shutil

import pytest

from _config_helpers import compose_config
from molt_hydra.cli import to_run_config
from molt_hydra.config.schema import ConfigError
from molt_hydra.runtime.validate import validate
from molt_hydra.runtime.plan import make_plan, model_shape

# a Qwen3-shaped config.json of ~1.3 T parameters: no disk here holds its 16 TB checkpoint
HUGE = dict(model_type="qwen3", vocab_size=151936, hidden_size=16384, intermediate_size=65536, num_hidden_layers=400,
            num_attention_heads=128, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def plan_of(*overrides: str):
    return make_plan(validate(to_run_config(compose_config(list(overrides)))))


def checkpoint_line(plan) -> str:
    return next(a for a in plan.assumptions if a.startswith("checkpoints: "))


def test_the_plan_states_the_checkpoint_size_and_the_free_disk(tmp_path):
    plan = plan_of(f"checkpoint.dir={tmp_path}/ck", "checkpoint.max_num=2")
    cfg = validate(to_run_config(compose_config([])))
    one = 12 * model_shape(cfg.model.path).params / 1e9
    line = checkpoint_line(plan)
    assert line.startswith(f"checkpoints: ~{one:.3g} GB each in {tmp_path}/ck (")
    assert f"up to 3 on disk at once: {3 * one:.3g} GB" in line and "FIT" not in line


def test_a_run_whose_first_checkpoint_cannot_fit_is_refused_and_a_dry_run_shows_it(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(HUGE))
    one = 12 * model_shape(str(tmp_path / "m")).params / 1e9
    assert one > shutil.disk_usage(tmp_path).free / 1e9  # the premise, from the definition
    args = [f"model.path={tmp_path}/m", f"model.tokenizer_path={tmp_path}/m", f"checkpoint.dir={tmp_path}/ck"]
    with pytest.raises(ConfigError) as e:
        make_plan(validate(to_run_config(compose_config(args))))
    assert str(e.value).startswith(f"- checkpoint.dir: one resumable checkpoint of this run is ~{one:.3g} GB")
    assert "Fix: checkpoint.dir on a disk with room, or checkpoint.save_steps=0" in str(e.value)
    assert "NOT ONE FITS" in checkpoint_line(plan_of(*args, "dry_run=true"))
    assert not any(a.startswith("checkpoints: ") for a in plan_of(*args, "checkpoint.save_steps=0").assumptions)


@pytest.mark.parametrize("key,value", [("checkpoint.save_hf", "true"), ("checkpoint.max_num", "5"),
                                       ("checkpoint.max_disk_gb", "10")])
def test_checkpoint_knobs_are_refused_when_no_checkpoint_is_written(key, value):
    with pytest.raises(ConfigError) as e:
        validate(to_run_config(compose_config(["checkpoint.save_steps=0", f"{key}={value}"])))
    assert f"- {key}: it shapes the resumable checkpoints, but checkpoint.save_steps=0 writes none." in str(e.value)


def test_a_disk_budget_below_one_checkpoint_is_refused_before_the_run_starts(tmp_path):
    """Before: the run trained its steps, then its first save failed it ('the newest checkpoint ... alone takes
    0.00433 GB, over the budget'). The budget is per checkpoint root, so a critic's root is sized alone."""
    cfg = validate(to_run_config(compose_config([])))
    one = 12 * model_shape(cfg.model.path).params / 1e9
    with pytest.raises(ConfigError) as e:
        plan_of(f"checkpoint.dir={tmp_path}/ck", f"checkpoint.max_disk_gb={one / 2}")
    assert str(e.value) == (f"- checkpoint.max_disk_gb: one resumable checkpoint of this run is ~{one:.3g} GB (4 + 8 "
                            f"bytes per parameter), over the budget of {one / 2} GB: its first save would fail the "
                            f"run, after its steps. Fix: raise checkpoint.max_disk_gb above {one:.3g}, or unset it")
    plan_of(f"checkpoint.dir={tmp_path}/ck", f"checkpoint.max_disk_gb={one * 1.5}")  # one fits
    plan_of(f"checkpoint.dir={tmp_path}/ck", f"checkpoint.max_disk_gb={one * 1.5}", "algorithm.estimator=gae",
            "parallelism.colocate_models=true")  # the actor's and the critic's each fit their own root's budget
